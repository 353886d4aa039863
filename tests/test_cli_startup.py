"""What one `kvstate` call costs and how it behaves as a Unix tool (issue 31 items 6 and
7): `import kvstate.cli` and `kvstate ls` load no numpy, transport, roles or Prometheus
client (tools/bench_cli.py has the times); `ls` and `show` have `--watch`; `ls | head`
exits quietly. The CLI runs as a user runs it: a process of its own, against a real
redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvstate
from kvstate.poll import KVPoll
from tests.helpers import scaled, wait_for

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "transports", "kvstate.roles", "kvstate.codec", "prometheus_client", "msgpack")
ADDR = "10.0.0.1:8998"


def _env(url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if url is not None:
        env["KVSTATE_REDIS_URL"] = url
    return env


def _loaded_by(code: str, url: str | None = None) -> set[str]:
    """The heavy modules loaded once ``code`` ran in a fresh interpreter."""
    probe = (
        f"import sys\n{code}\n"
        f"print('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=_env(url),
        timeout=scaled(60),
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED:"))
    return {m for m in line[len("LOADED:") :].split(",") if m}


def test_import_kvstate_cli_loads_nothing_a_listing_does_not_need() -> None:
    """`import kvstate.cli` took 0.89 s on the issue's host: numpy and the transport
    loaded to list rooms."""
    assert _loaded_by("import kvstate.cli") == set()
    assert _loaded_by("import kvstate") == set()
    # what was eager is still there, on first use
    loaded = _loaded_by(
        "import kvstate\nkvstate.KVManager, kvstate.LayoutError, kvstate.TransferInfo"
    )
    assert {"numpy", "transports", "kvstate.roles", "kvstate.codec"} <= loaded


def test_ls_and_show_run_without_the_heavy_modules(redis_url: str) -> None:
    code = (
        "from kvstate.cli import main\n"
        "for args in (['ls'], ['show', '5'], ['trace', '5']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, 1), exc.code\n"
    )
    assert _loaded_by(code, redis_url) - {"msgpack", "kvstate.codec", "numpy"} == set()
    assert _loaded_by(code.replace(", ['trace', '5']", ""), redis_url) == set()


@pytest.fixture
def managers(redis_url: str) -> Iterator[tuple[kvstate.KVManager, kvstate.KVManager]]:
    store = kvstate.connect(redis_url)
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        yield p, d
    store.close()


def _cli(*args: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvstate.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(url),
    )


def test_ls_watch_refreshes_until_ctrl_c(
    managers: tuple[kvstate.KVManager, kvstate.KVManager], redis_url: str
) -> None:
    """`kvstate ls --watch 200ms`: a room made while it runs shows up in a later
    refresh; SIGINT stops it with 130 and no traceback. (There was no --watch.)"""
    p, d = managers
    first = p.sender(1)
    assert first.poll() == KVPoll.Bootstrapping
    proc = _cli("ls", "--watch", "200ms", url=redis_url)
    seen: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")))
    reader.start()
    try:

        def refreshes() -> int:
            return "".join(seen).count("kvstate ls: every 200ms")

        assert wait_for(lambda: refreshes() >= 2, scaled(30))
        snd, rcv = p.sender(2), d.receiver(2, ADDR)
        rcv.init(np.arange(4))
        assert snd.poll() == KVPoll.WaitingForInput
        marked = len("".join(seen))
        assert wait_for(lambda: "WaitingForInput" in "".join(seen)[marked:], scaled(30))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=scaled(30))
        reader.join(scaled(30))
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    text = "".join(seen)
    assert text.count("(Ctrl-C stops)") >= 3 and "1 participant(s)" in text
    assert "3 participant(s)" in text


def test_show_watch_and_a_bad_period(
    managers: tuple[kvstate.KVManager, kvstate.KVManager], redis_url: str
) -> None:
    p, _ = managers
    assert p.sender(7).poll() == KVPoll.Bootstrapping
    proc = _cli("show", "7", "--watch", "0.2", url=redis_url)  # plain seconds too
    time.sleep(scaled(1.5))  # a few refreshes; what is checked is the output
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode == 143, err
    assert out.count("kvstate show 7: every 200ms") >= 2, out
    assert out.count("Bootstrapping") >= 2
    bad = subprocess.run(
        [sys.executable, "-m", "kvstate.cli", "ls", "--watch", "0"],
        capture_output=True,
        text=True,
        env=_env(redis_url),
        timeout=scaled(60),
    )
    assert bad.returncode == 2 and "--watch" in bad.stderr and "too short" in bad.stderr


def test_ls_into_a_closed_pipe_exits_quietly(
    managers: tuple[kvstate.KVManager, kvstate.KVManager], redis_url: str
) -> None:
    """`kvstate ls | head` exited 1 (the status of "findings"): a closed pipe is the
    reader's choice, reported as a Unix tool reports SIGPIPE (141), with no error."""
    p, _ = managers
    for room in range(1, 30):
        assert p.sender(room).poll() == KVPoll.Bootstrapping
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstate.cli", "ls"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(redis_url),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `head` read what it wanted and went away
    err = proc.stderr.read().decode()
    proc.wait(timeout=scaled(60))
    assert proc.returncode == 141, err
    assert err == "", err
