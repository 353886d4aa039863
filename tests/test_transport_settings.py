"""Transport settings between real processes: UCX defaults, environment overrides, ptrace.

Peers are the spawned processes of ``tests/transport_rig.py`` (real UCX endpoints,
every byte compared). The UCX segment sizes are checked through UCX itself: with
UCX's own receive segment (64K) a 384K send segment is refused ("Invalid
parameter"), so a transfer that works with only ``UCX_TCP_TX_SEG_SIZE=384K``
set proves kvstate's receive default reached UCX and the override won; an
unparsable override that makes UCX fail proves the environment is what UCX read.
The ptrace policy is observed with ``strace`` (the kernel keeps no readable
trace of ``PR_SET_PTRACER``, and without Yama the call changes nothing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")

from tests.helpers import scaled
from tests.transport_rig import LAYOUT, Peer, assert_layers, fragmented
from transports import cma
from transports.ucx import UCX_DEFAULTS

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
TCP = {"UCX_TLS": "tcp", "KVSTATE_UCX_CMA": "0"}  # the path used between hosts


def test_ucx_defaults_applied_and_environment_wins() -> None:
    rx = Peer("receiver", env=TCP)
    tx = Peer("sender", env=TCP | {"UCX_TCP_TX_SEG_SIZE": "384K"})
    try:
        assert rx.call("ucx_env") == UCX_DEFAULTS
        assert rx.call("ucx_env")["UCX_TCP_TX_SEG_SIZE"] == "256K"
        assert tx.call("ucx_env") == UCX_DEFAULTS | {"UCX_TCP_TX_SEG_SIZE": "384K"}
        ident = np.arange(LAYOUT[0][0], dtype=np.int32)
        src, dst = fragmented(np.random.default_rng(9), 80, LAYOUT[0][0])
        tx.call("write", 1, ident, [rx.target(ident)], 30.0)
        assert_layers(rx, [(ident, ident)])
        rx.call("refill")
        tx.call("write", 2, src, [rx.target(dst)], 30.0)
        assert_layers(rx, [(src, dst)])
    finally:
        tx.stop()
        rx.stop()


def test_same_host_ucx_puts_go_zero_copy_over_cma_with_error_handling_on(
    tmp_path: Path,
) -> None:
    """kvstate's UCX path on one host (its own CMA off), error handling on, with
    KVSTATE_UCX_RNDV_THRESH=inf: UCX's endpoint keeps a cma lane and puts go zero-copy
    over it, not emulated by active messages over loopback TCP (what ucxx's
    RNDV_THRESH of 8192, the default, makes UCX 1.21 build; transports/ucx/settings.py).
    Read from UCX's own log of its choices: the default shows the emulation."""
    from tools.bench.transfer.lanes import read

    def puts(key: str, extra: dict[str, str]) -> list[str]:
        log = {
            "KVSTATE_UCX_CMA": "0",
            "UCX_LOG_LEVEL": "info",
            "UCX_PROTO_INFO": "y",
            "UCX_LOG_FILE": f"{tmp_path}/same-host.{key}.%p.log",
        }
        rx = Peer("receiver", env=log | extra)
        tx = Peer("sender", env=log | extra)
        try:
            ident = np.arange(LAYOUT[0][0], dtype=np.int32)
            tx.call("write", 1, ident, [rx.target(ident)], 30.0)
            assert_layers(rx, [(ident, ident)])
        finally:
            tx.stop()
            rx.stop()
        return [line for line in read(str(tmp_path))["same-host"][key] if line.startswith("put")]

    zcopy = puts("inf", {"KVSTATE_UCX_RNDV_THRESH": "inf"})
    assert zcopy and all("zero-copy via cma/memory" in p for p in zcopy), zcopy
    default = puts("default", {})  # ucxx's threshold (the default: settings.py says why)
    assert default and all("software emulation via tcp" in p for p in default), default


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_after_ucx_transfers_takes_no_cpu() -> None:
    """After UCX puts, idle sender and receiver must not spin (ucxx's blocking progress
    left the worker unarmed and its event loop spun a core in both)."""
    rx = Peer("receiver", env=TCP)
    tx = Peer("sender", env=TCP)
    try:
        ident = np.arange(LAYOUT[0][0], dtype=np.int32)
        for room in range(3):
            tx.call("write", room, ident, [rx.target(ident)], 30.0)
        assert_layers(rx, [(ident, ident)])
        pids = [p.proc.pid or 0 for p in (rx, tx)]
        time.sleep(scaled(0.5))  # let the last completions settle
        before = [_cpu_seconds(pid) for pid in pids]
        time.sleep(2.0)
        used = [_cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
        # A spinning process gets >= 0.4 s of these 2 s even on a loaded 2-core host.
        assert max(used) < 0.15, f"idle CPU seconds over 2 s (receiver, sender): {used}"
    finally:
        tx.stop()
        rx.stop()


def test_conflicting_segment_sizes_are_a_clear_error() -> None:
    with pytest.raises(AssertionError) as err:
        Peer("receiver", env=TCP | {"UCX_TCP_RX_SEG_SIZE": "128K"})
    text = str(err.value)
    assert "TransportError" in text
    assert "UCX_TCP_TX_SEG_SIZE=256K is larger than UCX_TCP_RX_SEG_SIZE=128K" in text
    assert "set both" in text


def test_puts_cut_to_a_small_chunk_land_every_byte() -> None:
    """KVSTATE_UCX_PUT_CHUNK=1000 (no page size divides it) cuts every run into puts
    that end mid-page; contiguous and fragmented writes must still land exactly."""
    rx = Peer("receiver", env=TCP)
    tx = Peer("sender", env=TCP | {"KVSTATE_UCX_PUT_CHUNK": "1000"})
    try:
        ident = np.arange(LAYOUT[0][0], dtype=np.int32)
        tx.call("write", 1, ident, [rx.target(ident)], 30.0)
        assert_layers(rx, [(ident, ident)])
        rx.call("refill")
        src, dst = fragmented(np.random.default_rng(4), 70, LAYOUT[0][0])
        tx.call("write", 2, src, [rx.target(dst)], 30.0)
        assert_layers(rx, [(src, dst)])
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("KVSTATE_UCX_PUT_CHUNK", "lots", "KVSTATE_UCX_PUT_CHUNK='lots' is not a size"),
        ("KVSTATE_CMA_THREADS", "0", "KVSTATE_CMA_THREADS='0' is not a whole number >= 1"),
    ],
)
def test_bad_chunk_and_thread_settings_are_refused(var: str, value: str, needle: str) -> None:
    with pytest.raises(AssertionError) as err:
        Peer("receiver", env=TCP | {var: value})
    assert "TransportError" in str(err.value)
    assert needle in str(err.value)


def test_environment_reaches_ucx() -> None:
    """An override UCX cannot parse makes UCX itself fail: UCX read our environment."""
    with pytest.raises(AssertionError) as err:
        Peer("receiver", env=TCP | {"UCX_TCP_RX_SEG_SIZE": "lots"})
    text = str(err.value)
    assert "starting UCX failed" in text
    assert "'UCX_TCP_RX_SEG_SIZE': 'lots'" in text


# ---------------------------------------------------------------------------
# ptrace: PR_SET_PTRACER only when asked for, logged once.

_REGISTER_TWICE = """
import logging, numpy as np
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
from transports.ucx import UCXTransport
t = UCXTransport()
for _ in range(2):
    t.register_buffers([np.zeros(8192, dtype=np.uint8)], [4096])
t.close()
print("registered")
"""


def _register_under_strace(tmp_path: Path, ptracer: str | None) -> tuple[str, str]:
    """(prctl calls seen by strace, the process's log) for a transport registering twice."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: PR_SET_PTRACER leaves no other trace")
    env = {k: v for k, v in os.environ.items() if k != cma.PTRACER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if ptracer is not None:
        env[cma.PTRACER_ENV] = ptracer
    trace = tmp_path / "prctl.txt"
    proc = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=prctl",
            "-o",
            str(trace),
            sys.executable,
            "-c",
            _REGISTER_TWICE,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(90),
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr and not trace.exists():
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    assert "registered" in proc.stdout
    calls = "\n".join(line for line in trace.read_text().splitlines() if "PTRACER" in line)
    logs = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("LOG "))
    return calls, logs


def test_default_leaves_ptrace_alone(tmp_path: Path) -> None:
    calls, logs = _register_under_strace(tmp_path, None)
    assert calls == ""
    lines = [line for line in logs.splitlines() if cma.PTRACER_ENV in line]
    assert len(lines) == 1, logs  # once per process, not per registration
    assert f"{cma.PTRACER_ENV}=off: ptrace rights left as they are" in lines[0]


def test_opt_in_any(tmp_path: Path) -> None:
    calls, logs = _register_under_strace(tmp_path, "any")
    assert "PR_SET_PTRACER, PR_SET_PTRACER_ANY" in calls
    lines = [line for line in logs.splitlines() if cma.PTRACER_ENV in line]
    assert len(lines) == 1, logs
    assert f"{cma.PTRACER_ENV}=any: PR_SET_PTRACER" in lines[0]
    assert "any process of this user" in lines[0]


def test_opt_in_one_pid(tmp_path: Path) -> None:
    calls, logs = _register_under_strace(tmp_path, "4242")
    assert "PR_SET_PTRACER, 4242" in calls
    assert "process 4242" in logs


@pytest.mark.parametrize("raw", ["everyone", "-3", "1.5"])
def test_bad_ptracer_value_is_refused(raw: str) -> None:
    with pytest.raises(cma.PtracerError, match="KVSTATE_CMA_PTRACER=.* is not understood"):
        cma.parse_ptracer(raw)


@pytest.mark.parametrize(
    ("raw", "want"), [(None, "off"), ("", "off"), ("OFF", "off"), ("any", "any"), (" 17 ", 17)]
)
def test_ptracer_values(raw: str | None, want: str | int) -> None:
    assert cma.parse_ptracer(raw) == want


def test_cma_still_used_by_default_where_the_kernel_allows() -> None:
    """Same host, default settings: the CMA path still moves the bytes (as root, or with
    Yama off, no ptracer grant is needed)."""
    rx = Peer("receiver")
    tx = Peer("sender")
    try:
        src, dst = fragmented(np.random.default_rng(3), 50, LAYOUT[0][0])
        tx.call("write", 3, src, [rx.target(dst)], 20.0)
        assert_layers(rx, [(src, dst)])
    finally:
        tx.stop()
        rx.stop()
