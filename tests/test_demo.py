"""``kvstate demo`` end to end: real worker processes, real UCX, real (embedded) Redis.

Each run starts its own embedded redis-server (no URL in the environment), so these
tests also cover the zero-setup path (docs/design.md, Zero setup). Pages and pools are small so
a run takes seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kvstate.demo import demo, expected_pages
from kvstate.demo.outcome import Track
from kvstate.ops import reads
from kvstate.testing.process import free_port
from tests.helpers import DEMO_SMALL as SMALL
from tests.helpers import demo_command as _command
from tests.helpers import demo_env as _env
from tests.helpers import scaled

PAGE_BYTES, LAYERS = 4096, 2


AUTHKEY = "test-secret-" + os.urandom(8).hex()


def run_demo(*args: str, timeout: float = 120) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [*_command(), *args, "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=scaled(timeout),
    )
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON summary (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.returncode, doc, proc.stderr


def check_successes(doc: dict[str, Any]) -> None:
    """Every room the decode side saw succeed had every byte verified, and the byte
    count adds up."""
    ok = [r for r in doc["rooms"] if r["decode_status"] == "Success"]
    assert ok
    for r in ok:
        assert r["verified"] is True and r["bad_pages"] == 0, r
    done = [r for r in doc["rooms"] if r["outcome"] == "done"]
    assert doc["bytes_verified"] == sum(r["pages"] for r in done) * PAGE_BYTES * LAYERS
    assert doc["all_success_verified"] is True


def test_demo_without_url_verifies_every_byte_and_leaves_no_key() -> None:
    rc, doc, err = run_demo("--requests", "50", "--seed", "7", *SMALL)
    assert rc == 0, err
    assert doc["ok"] is True
    assert doc["outcomes"]["done"] == 50
    assert doc["outcomes"]["failed"] == doc["outcomes"]["corrupt"] == 0
    assert doc["keys_left"] == 0
    check_successes(doc)
    assert doc["redis"]["url"].startswith("unix://")  # the embedded server
    assert doc["redis"]["commands_per_room"] > 0
    assert doc["audit"]["result"] in ("clean", "n/a")
    assert doc["latency_ms"]["p99"] >= doc["latency_ms"]["p50"] > 0
    assert doc["write_gb_per_s"] >= doc["send_gb_per_s"] >= doc["gb_per_s"] > 0
    assert doc["workers"]["transport"]["prefill-0"]["bytes_moved"] == doc["bytes_verified"]
    # the --hold hint says what holding would cost (issue 31: it hid that the run then
    # takes minutes): 50 rooms in waves of --inflight 8 -> 7 x 30s
    assert (
        "--hold 30s keeps each one visible for 30 s, and then 50 rooms, 8 at a time, "
        "take at least 3m30s" in err
    ), err


def test_demo_killed_prefill_fails_its_rooms_by_lease_and_leaves_no_key() -> None:
    rc, doc, err = run_demo(
        "--requests",
        "40",
        "--prefill-workers",
        "2",
        "--decode-workers",
        "2",
        "--kill-prefill-after",
        "10",
        "--seed",
        "11",
        *SMALL,
    )
    assert rc == 0, err
    killed = doc["killed"]
    assert killed in ("prefill-0", "prefill-1")
    rooms = doc["rooms"]
    lost = [r for r in rooms if r["outcome"] == "killed"]
    assert lost, "the killed worker had rooms in flight"
    for r in lost:
        assert r["prefill"] == killed
        assert r["decode_status"] == "Failed"
        assert killed in r["decode_reason"], r  # the reason names the dead peer
    assert doc["outcomes"]["failed"] == doc["outcomes"]["corrupt"] == 0
    assert doc["outcomes"]["done"] == 40 - len(lost)
    check_successes(doc)
    assert doc["keys_left"] == 0  # the dead sender's keys expired with the room TTL


def test_demo_aborts_are_counted_and_leave_no_key() -> None:
    rc, doc, err = run_demo("--requests", "60", "--abort-rate", "0.2", "--seed", "3", *SMALL)
    assert rc == 0, err
    aborts = doc["aborts"]
    assert aborts["injected"] >= 5
    assert doc["outcomes"]["aborted"] == aborts["landed"] >= 1
    for r in doc["rooms"]:
        if r["outcome"] == "aborted":
            assert r["abort"] in ("prefill", "decode", "router")
            assert "abort" in (r["decode_reason"] + r["prefill_reason"]), r
        else:
            assert r["outcome"] == "done", r
    check_successes(doc)
    assert doc["keys_left"] == 0


def test_demo_router_and_standalone_workers() -> None:
    """The docker-compose shape: a router serving its queues, workers attached by TCP."""
    addr = f"127.0.0.1:{free_port()}"
    env = _env(KVSTATE_DEMO_AUTHKEY=AUTHKEY)
    router = subprocess.Popen(
        [*_command(), "--listen", addr, "--requests", "20", "--json", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    workers = [
        subprocess.Popen(
            [*_command(), "--worker", role, "--engine", f"{role}-0", "--router", addr],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in ("prefill", "decode")
    ]
    try:
        out, err = router.communicate(timeout=scaled(120))
        logs = [w.communicate(timeout=scaled(30))[1] for w in workers]
        for w, text in zip(workers, logs, strict=True):
            assert w.returncode == 0, text
    finally:
        for p in (router, *workers):
            if p.poll() is None:
                p.kill()
    assert router.returncode == 0, err
    doc = json.loads(out)
    assert doc["outcomes"]["done"] == 20 and doc["keys_left"] == 0
    check_successes(doc)
    # the workers log what they do (docker compose logs shows it)
    assert "prefill-0: prefill engine registered at" in logs[0]
    assert logs[0].count(" Success") == 20 and logs[1].count(" Success") == 20


# --------------------------------------------------------------------------- no processes


def test_pattern_differs_per_room_page_and_layer() -> None:
    pages = np.arange(4)
    a = expected_pages(5, pages, 0, 256)
    assert a.shape == (4, 256) and a.dtype == np.uint8
    assert not np.array_equal(a, expected_pages(6, pages, 0, 256))
    assert not np.array_equal(a, expected_pages(5, pages, 1, 256))
    assert len({bytes(row) for row in a}) == 4  # every page its own bytes
    words = a[0].view(np.uint64)
    assert len(set(words.tolist())) == len(words)  # a shifted page cannot match
    assert np.array_equal(a, expected_pages(5, pages, 0, 256))  # deterministic
    big = expected_pages(2**63 - 1, pages, 3, 64)
    assert big.shape == (4, 64)


@pytest.mark.parametrize(
    "args, text",
    [
        (["--pages-per-request", "10-5"], "MIN <= MAX"),
        (["--pages-per-request", "2000"], "do not fit a pool"),
        (["--page-bytes", "100"], "multiple of 64"),
        (["--kill-prefill-after", "3"], "--prefill-workers 2"),
        (["--worker", "prefill"], "--engine and --router"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(args: list[str], text: str) -> None:
    result = CliRunner().invoke(demo, args, env={"KVSTATE_REDIS_URL": None})
    assert result.exit_code == 2, result.output
    assert text in result.output


def test_cuda_without_a_device_is_a_clear_error() -> None:
    try:
        from kvstate.demo.pattern import cuda_backend

        cuda_backend()
    except Exception:
        pass
    else:
        pytest.skip("this machine has a CUDA device")
    result = CliRunner().invoke(demo, ["--device", "cuda"], env={"KVSTATE_REDIS_URL": None})
    assert result.exit_code == 2
    assert "--device cuda needs a CUDA device" in result.output


@pytest.mark.parametrize(
    "args",
    [["--requests", "1"], ["--worker", "prefill", "--engine", "prefill-0", "--router", "h:1"]],
)
def test_without_ucx_the_demo_says_which_extra_to_install(args: list[str]) -> None:
    """UCX is the ``kvstate[ucx]`` extra: without ucxx the demo exits 2 with one line
    naming it, before any server or worker starts (as if ucxx were not installed)."""
    script = (
        "import sys; sys.modules['ucxx'] = None\n"
        "from kvstate.demo.command import demo\n"
        "demo(sys.argv[1:])\n"
    )
    env = _env(KVSTATE_DEMO_AUTHKEY=AUTHKEY)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(120),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "kvstate demo: error: the demo's workers move KV pages with UCX and ucxx is not "
        "installed here: pip install 'kvstate[ucx]'"
    ]
    assert "redis" not in proc.stderr.lower()


def test_outcome_classification() -> None:
    from kvstate.demo import Job, Result

    job = Job(1, 4, "prefill-0", "a:1")

    def track(rx: Result | None, tx: Result | None, abort: str = "", dead: bool = False) -> str:
        t = Track(job, "decode-0", 0.0, abort, prefill_dead=dead)
        for r in (rx, tx):
            if r is not None:
                t.results[r.role] = r
        return t.outcome("prefill-0" if dead else None)

    ok_rx = Result(1, "decode", "decode-0", "Success", verified=True)
    bad_rx = Result(1, "decode", "decode-0", "Success", verified=False, bad_pages=1)
    ok_tx = Result(1, "prefill", "prefill-0", "Success")
    gone = Result(1, "decode", "decode-0", "Failed", "peer prefill-0 lost its lease")
    aborted = Result(1, "decode", "decode-0", "Failed", "demo fault: ... aborted")
    assert track(ok_rx, ok_tx) == "done"
    assert track(bad_rx, ok_tx) == "corrupt"
    assert track(ok_rx, None, dead=True) == "done"
    assert track(gone, None, dead=True) == "killed"
    assert track(aborted, ok_tx, abort="decode") == "aborted"
    assert track(aborted, ok_tx) == "failed"  # an abort nobody injected is a failure


@pytest.mark.slow
def test_demo_load_two_by_two_with_every_fault() -> None:
    """The load shape (2 prefill x 2 decode, 16 KiB pages) with aborts and a kill at once."""
    rc, doc, err = run_demo(
        "--requests",
        "200",
        "--prefill-workers",
        "2",
        "--decode-workers",
        "2",
        "--pages-per-request",
        "4-64",
        "--pool-pages",
        "512",
        "--abort-rate",
        "0.1",
        "--kill-prefill-after",
        "100",
        "--seed",
        "5",
        "--inflight",
        "16",
    )
    assert rc == 0, err
    o = doc["outcomes"]
    assert o["failed"] == o["corrupt"] == 0
    assert o["killed"] >= 1 and o["aborted"] >= 1
    assert o["done"] + o["killed"] + o["aborted"] == 200
    assert doc["keys_left"] == 0
    ok = [r for r in doc["rooms"] if r["decode_status"] == "Success"]
    assert ok and all(r["verified"] for r in ok)


def test_the_store_operations_the_demo_uses(redis_url: str) -> None:
    """What the demo asks of the Store: the mark an abort of a finished room leaves is
    taken back, published transfer counters are dropped once read, and the command
    counts grow by the commands run."""
    import kvstate
    from kvstate.stats import TransferRecorder, drop_call

    store = kvstate.connect(redis_url, "demo-store")
    try:
        assert store.abort(7, "both sides had finished") == 0  # failed nobody, left its mark
        mark = store.keys.aborted(7)
        assert list(store.scan(mark)) == [mark]
        recorder = TransferRecorder(store, "prefill-0")
        recorder.observe(4096, 0.001)
        recorder.close()
        stats = store.keys.transfer_stats("prefill-0")
        assert list(store.scan(stats)) == [stats]
        before = store.command_counts()
        store.execute([reads.unmark(store.keys, 7), drop_call(store, "prefill-0")])
        assert store.command_counts().get("del", 0) == before.get("del", 0) + 2
        assert list(store.scan(store.keys.all_pattern)) == []
    finally:
        store.close()
