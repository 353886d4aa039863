"""Issue 11: what the operator tools say must be true. Each test runs the real command
(in process through click, or as a subprocess) against a real redis-server and checks
its output and exit status (0 ok, 1 findings or nothing found, 2 error)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner, Result

import kvstate
from kvstate.cli import OPERATOR_ACL, OPERATOR_ACL_7, READER_ACL, READER_ACL_7, main
from kvstate.ops.audit import Auditor
from kvstate.ops.ledger import Entry, Ledger
from kvstate.ops.metrics import Metrics
from kvstate.ops.monitor import Monitor
from kvstate.ops.repairs import Repairs
from kvstate.poll import KVPoll
from kvstate.store import Store
from kvstate.testing import RedisProcess
from tests.helpers import engine_acl, load_functions, redis_major, scaled, wait_for

ADDR = "10.0.0.1:8998"
KVSTATE_BIN = Path(sys.executable).with_name("kvstate")
SECURITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server only."""
    return redis_url


def live_room(
    store: Store, room: int, prefill: str = "prefill-a.tp0", decode: str = "decode-b.tp0"
) -> tuple[Any, Any, Any, Any]:
    p = kvstate.KVManager(store, "prefill", prefill, ADDR)
    d = kvstate.KVManager(store, "decode", decode)
    snd, rcv = p.sender(room), d.receiver(room, ADDR)
    rcv.init(np.arange(8))
    assert snd.poll() == KVPoll.WaitingForInput
    return p, d, snd, rcv


# --------------------------------------------------------------------------- item 1


def churn(url: str, worker: int, stop: Event, results: Queue) -> None:
    """One engine pair driving rooms through their whole life (create, publish, begin,
    finish, poll, clear) as fast as it can: a busy, healthy namespace."""
    store = kvstate.connect(url)
    addr = f"10.1.0.{worker}:1"
    p = kvstate.KVManager(store, "prefill", f"prefill-{worker}", addr)
    d = kvstate.KVManager(store, "decode", f"decode-{worker}")
    room = worker * 10_000_000
    while not stop.is_set():
        room += 1
        snd, rcv = p.sender(room), d.receiver(room, addr)
        rcv.init(np.arange(4))
        snd.poll()
        if room % 5 == 0:  # some rooms fail instead, and are cleared all the same
            rcv.abort("churn")
        else:
            snd.begin_transfer()
            snd.finish_transfer()
        rcv.poll()
        snd.clear()
        rcv.clear()
    p.close()
    d.close()
    store.close()
    results.put(room - worker * 10_000_000)


def test_audit_finds_nothing_on_a_busy_healthy_namespace(
    redis_url: str, spawn_ctx: SpawnContext
) -> None:
    """Three processes churn rooms while audit (and audit --fix) run in a loop: every
    run is clean and exits 0. Before the second look, a room cleared between the SCAN
    and the index check read as `unindexed`."""
    results: Queue = spawn_ctx.Queue()
    stop = spawn_ctx.Event()
    procs = [spawn_ctx.Process(target=churn, args=(redis_url, w, stop, results)) for w in (1, 2, 3)]
    for proc in procs:
        proc.start()
    store = kvstate.connect(redis_url)
    try:
        assert wait_for(lambda: any(True for _ in store.scan(store.keys.participant_pattern)), 30)
        runs, seen_rooms = 0, 0
        deadline = time.monotonic() + scaled(7)
        while time.monotonic() < deadline:
            for args in (["audit", "--json"], ["audit", "--json", "--fix"]):
                result = run("--url", redis_url, *args)
                doc = json.loads(result.stdout)
                assert result.exit_code == 0, result.output
                assert doc["findings"] == [] or all(f["resolved"] for f in doc["findings"]), doc
                seen_rooms += doc["scanned_keys"]
                runs += 1
        assert runs >= 6 and seen_rooms > 0
        # the monitor's findings gauge, refreshed on every sweep, stays at 0 throughout
        auditor, gauges = Auditor(store), []

        def audit_counts() -> dict[str, int]:
            gauges.append(auditor.run().counts())
            return gauges[-1]

        metrics = Metrics()
        Monitor(store, 0.05, metrics=metrics, audit=audit_counts, audit_interval=0).run(
            duration=2.5
        )
        assert len(gauges) >= 5 and all(sum(g.values()) == 0 for g in gauges), gauges
        assert 'kvstate_audit_findings{kind="unindexed"} 0.0' in metrics.render().decode()
        assert all(proc.is_alive() for proc in procs)  # the load lasted throughout
    finally:
        stop.set()
        for proc in procs:
            proc.join(60)
        store.close()
    done = [results.get(timeout=scaled(10)) for _ in procs]
    assert all(n > 10 for n in done), done


def test_audit_finds_nothing_while_the_demo_runs(redis_url: str, tmp_path: Path) -> None:
    """The issue's own check: `kvstate demo --url` (real workers, real transfers, some
    aborted rooms) against one redis-server, `kvstate audit` in a loop: 0 findings."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_REDIS_URL"}
    out_file, err_file = (tmp_path / "out").open("w+"), (tmp_path / "err").open("w+")
    demo = subprocess.Popen(  # files, not pipes: its progress output must never block it
        [
            str(KVSTATE_BIN),
            "demo",
            "--url",
            redis_url,
            "--namespace",
            "busy",
            "--json",
            "--requests",
            "3000",
            "--inflight",
            "16",
            "--prefill-workers",
            "2",
            "--decode-workers",
            "2",
            "--abort-rate",
            "0.05",
            "--seed",
            "11",
        ],
        stdout=out_file,
        stderr=err_file,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    runs, deadline = 0, time.monotonic() + scaled(240)
    try:
        while demo.poll() is None and time.monotonic() < deadline:
            for args in (["audit", "--json"], ["audit", "--json", "--fix"]):
                result = run("--url", redis_url, "-n", "busy", *args)
                doc = json.loads(result.stdout)
                if doc.get("namespace_empty"):  # before the first room, after the last
                    assert result.exit_code == 1
                    continue
                assert result.exit_code == 0, result.output
                assert all(f["resolved"] for f in doc["findings"]), doc
                runs += 1
        demo.wait(timeout=scaled(60))
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    err, out = Path(err_file.name).read_text(), Path(out_file.name).read_text()
    # The demo's own verdict is not this test's: at the time of writing it can end with
    # a router's abort mark left behind (its issue, item 2), which no audit here wrote.
    assert demo.returncode in (0, 1), err[-2000:]
    assert json.loads(out)["outcomes"]["done"] > 1000, out[-2000:]
    assert runs >= 4


def test_fix_of_a_room_cleared_meanwhile_is_resolved_not_left(store: Store) -> None:
    """The fix finds the room gone: nothing to do, not a finding left (exit 0)."""
    p, d, snd, rcv = live_room(store, 5)
    store.client.hdel(store.keys.room_hash(5), "tx:prefill-a.tp0")  # unindexed sender

    report = Auditor(store).run()
    snd.clear()  # between the audit's look and its repair
    rcv.clear()
    Repairs(store).fix(report)
    assert [f.kind for f in report.findings] == ["unindexed"]
    assert report.findings[0].resolved == "it was cleared meanwhile"
    assert report.remaining == []
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 2


def test_abort_refuses_rooms_with_nothing_to_abort(store: Store, redis_url: str) -> None:
    p, d, snd, rcv = live_room(store, 21)
    before = sorted(store.scan(store.keys.all_pattern))
    for args in (["abort", "22"], ["abort", "21", "-n", "other"]):  # mistyped, other ns
        result = run("--url", redis_url, *args)
        assert result.exit_code == 1, result.output
        assert "nothing to abort" in result.output and "nothing written" in result.output
    assert sorted(store.scan(store.keys.all_pattern)) == before
    assert list(store.scan("kvstate:other:*")) == []
    # a finished room, once cleared, is refused too: a late abort must not leave a mark
    snd.begin_transfer()
    snd.finish_transfer()
    assert rcv.poll() == KVPoll.Success
    snd.clear()
    rcv.clear()
    result = run("--url", redis_url, "abort", "21")
    assert result.exit_code == 1
    assert store.client.exists(store.keys.aborted(21)) == 0
    # a room whose participants failed on their own: already marked, said so
    p.sender(22).poll()
    d.receiver(22, ADDR).poll()
    for side, engine in (("tx", "prefill-a.tp0"), ("rx", "decode-b.tp0")):
        store.execute([store.update(22, side, engine, KVPoll.Failed, "boom")])  # type: ignore[arg-type]
    result = run("--url", redis_url, "abort", "22")
    assert result.exit_code == 0 and "already failed (boom)" in result.output, result.output
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 3


def test_url_and_namespace_after_every_subcommand(store: Store, redis_url: str) -> None:
    p, d, snd, rcv = live_room(store, 31)
    cases: list[tuple[list[str], int]] = [
        (["show", "31"], 0),
        (["ls"], 0),
        (["top", "--once"], 0),
        (["engines"], 0),
        (["audit"], 0),
        (["doctor", "--no-ucx"], 0),
        (["monitor", "--duration", "200ms", "--interval", "100ms"], 0),
        (["abort", "31"], 0),
    ]
    for args, code in cases:
        result = run(*args, "--url", redis_url, "-n", "default")
        assert result.exit_code == code, (args, result.output)
        assert "No such option" not in result.output
    # after the subcommand wins over before it; the namespace too
    result = run("--url", "redis://127.0.0.1:1", "ls", "--url", redis_url, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["count"] == 2
    result = run("--url", redis_url, "-n", "default", "ls", "--namespace", "other", "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["namespace"] == "other"
    # the environment variable is still read, and an option after the subcommand beats it
    result = run("ls", "--json", env={"KVSTATE_REDIS_URL": "redis://127.0.0.1:1"})
    assert result.exit_code == 2
    result = run("ls", "--url", redis_url, env={"KVSTATE_REDIS_URL": "redis://127.0.0.1:1"})
    assert result.exit_code == 0, result.output
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 4


def test_fix_gives_the_room_its_remaining_ttl(store: Store, redis_url: str) -> None:
    p, d, snd, rcv = live_room(store, 41)
    c = store.client
    room_keys = [snd.key, rcv.key, store.keys.room_hash(41)]
    for key in room_keys:
        c.pexpire(key, 36_000)  # the room has 36 s left
    mark = store.keys.aborted(41)
    c.hset(mark, "reason", "boom")  # planted without a TTL
    tracker_ttl = c.pttl(store.keys.tracker(ADDR, 41))
    result = run("--url", redis_url, "audit", "--fix", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(f["kind"], f["key"]) for f in doc["findings"]] == [("no_ttl", mark)]
    assert "room's remaining TTL" in doc["findings"][0]["fixed"]
    assert 30_000 < c.pttl(mark) <= 36_000
    assert all(30_000 < c.pttl(k) <= 36_000 for k in room_keys)  # untouched
    assert c.pttl(store.keys.tracker(ADDR, 41)) <= tracker_ttl  # keys with a TTL keep theirs
    # re-indexing a participant gives the index the room's TTL, not --room-ttl's 900 s
    c.hdel(store.keys.room_hash(41), "rx:decode-b.tp0")
    result = run("--url", redis_url, "audit", "--fix", "--json")
    assert result.exit_code == 0, result.output
    assert [f["kind"] for f in json.loads(result.stdout)["findings"]] == ["unindexed"]
    assert store.members(41) == ["rx:decode-b.tp0", "tx:prefill-a.tp0"]
    assert 0 < c.pttl(store.keys.room_hash(41)) <= 36_000
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 5


def test_empty_namespace_is_named_not_clean(store: Store, redis_url: str) -> None:
    empty = {"audit": ["audit"], "ls": ["ls"], "engines": ["engines"], "top": ["top", "--once"]}
    for name, args in empty.items():  # a Redis without any kvstate key
        result = run("--url", redis_url, "-n", "typo", *args)
        assert result.exit_code == 1, (name, result.output)
        assert "namespace typo holds no kvstate key" in result.output, name
        assert "namespaces in this Redis: none" in result.output, name
    p, d, snd, rcv = live_room(store, 51)
    for name, args in empty.items():
        result = run("--url", redis_url, "-n", "typo", *args)
        assert result.exit_code == 1, (name, result.output)
        assert "namespaces in this Redis: default" in result.output, name
        result = run("--url", redis_url, "-n", "typo", *args, "--json")
        doc = json.loads(result.stdout)
        assert result.exit_code == 1 and doc["namespace_empty"] is True, name
        assert doc["namespaces"] == ["default"], name
        assert run("--url", redis_url, *args).exit_code == 0, name
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 6


def test_show_and_ls_find_a_running_demo(
    redis_server_factory: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    """Without a URL the CLI reads the demo's discovery record; a record whose process
    is gone is skipped, even when it is newer."""
    server = redis_server_factory(unix_socket=True, port=0)
    store = kvstate.connect(server.unix_url, namespace="demo-1a2b")
    p, d, snd, rcv = live_room(store, 61)
    (tmp_path / f"kvstate-demo-{os.getpid()}.json").write_text(
        json.dumps({"url": server.unix_url, "namespace": "demo-1a2b", "pid": os.getpid()})
    )
    dead = subprocess.Popen(["true"])  # a pid that is not running any more
    dead.wait()
    stale = tmp_path / f"kvstate-demo-{dead.pid}.json"
    stale.write_text(
        json.dumps({"url": "redis://127.0.0.1:1", "namespace": "stale", "pid": dead.pid})
    )
    newer = (tmp_path / f"kvstate-demo-{os.getpid()}.json").stat().st_mtime + 1
    os.utime(stale, (newer, newer))  # newer than the live one, whatever the clock resolution
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "KVSTATE_REDIS_URL": "", "KVSTATE_NAMESPACE": ""}
    result = run("ls", "--json", env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["count"] == 2
    assert f"using the running demo (pid {os.getpid()})" in result.stderr
    assert "namespace demo-1a2b" in result.stderr
    result = run("show", "61", env=env)
    assert result.exit_code == 0 and "decode-b.tp0" in result.stdout
    result = run("ls", "-n", "default", env=env)  # an explicit namespace still wins
    assert result.exit_code == 1 and "namespace default holds no kvstate key" in result.output
    (tmp_path / f"kvstate-demo-{os.getpid()}.json").unlink()  # the demo exited
    result = run("ls", env=env)
    assert result.exit_code == 2 and "no Redis URL" in result.output
    p.close()
    d.close()
    store.close()


# --------------------------------------------------------------------------- item 7


def test_top_waits_for_redis_across_a_restart(
    redis_server_factory: Callable[..., RedisProcess], tmp_path: Path
) -> None:
    server = redis_server_factory(port="auto")
    err = (tmp_path / "err").open("w+")
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_REDIS_URL"}
    proc = subprocess.Popen(
        [str(KVSTATE_BIN), "top", "--url", server.tcp_url, "--interval", "200ms"],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
    )
    probe = redis.Redis.from_url(server.tcp_url)

    def censuses() -> int:  # each census reads the server clock once (TIME)
        stats = probe.info("commandstats")
        return int(stats.get("cmdstat_time", {}).get("calls", 0))

    try:
        # a second census means the first one is done and top is in its refresh loop
        # (its start-up takes seconds on a loaded machine: a fixed wait raced it)
        assert wait_for(lambda: proc.poll() is not None or censuses() >= 2, 60)
        assert proc.poll() is None, Path(err.name).read_text()
        probe.close()
        server.kill()
        assert wait_for(lambda: "waiting for it" in Path(err.name).read_text(), 30)
        time.sleep(0.5)
        assert proc.poll() is None, "top exited when Redis went away"
        server.restart()
        assert wait_for(lambda: "is back" in Path(err.name).read_text(), 30)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=scaled(30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, Path(err.name).read_text()
    assert "Traceback" not in Path(err.name).read_text()
    assert "kvstate top" in out


# --------------------------------------------------------------------------- item 8


@pytest.mark.parametrize("query", ["?cluster=true", "?socket_timeout=abc", "?foo=bar"])
def test_url_query_errors_are_one_line(redis_tcp_url: str, query: str) -> None:
    for args in (["ls"], ["audit"], ["top", "--once"]):
        result = run("--url", redis_tcp_url + "/0" + query, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


# --------------------------------------------------------------------------- item 9


def test_names_with_brackets_print_literally(store: Store, redis_url: str) -> None:
    name = "prefill[/bold][red]-a[0]"
    p, d, snd, rcv = live_room(store, 91, prefill=name, decode="decode[x]")
    for args in (["show", "91"], ["ls"], ["engines"], ["top", "--once"], ["audit"]):
        result = run("--url", redis_url, *args)
        assert result.exit_code == 0, (args, result.output)
        if args[0] != "top" and args[0] != "audit":
            assert name in result.output and "decode[x]" in result.output, args
    p.close()
    d.close()


def test_room_ids_are_ascii_digits(store: Store, redis_url: str) -> None:
    p, d, snd, rcv = live_room(store, 42)
    for bad in ("4_2", "\u0664\u0662", " 42", "+42", "42.0", "0x2a"):
        for args in (["show", bad], ["abort", bad]):
            result = run("--url", redis_url, *args)
            assert result.exit_code == 2, (bad, result.output)
            assert "room must be" in result.output and "ASCII" in result.output
    assert snd.poll() == KVPoll.WaitingForInput  # nothing was aborted
    # a hand-written key with such a tag is not read as room 42 either
    store.client.set("kvstate:default:{4_2}:tx:ghost", "x", px=60_000)
    doc = json.loads(run("--url", redis_url, "ls", "--json").stdout)
    assert sorted(p_["engine"] for p_ in doc["participants"]) == ["decode-b.tp0", "prefill-a.tp0"]
    p.close()
    d.close()


# --------------------------------------------------------------------------- item 13


def operator_acl(admin: redis.Redis) -> str:
    """docs/security.md's operator line for this server (7.x: with FCALL and FUNCTION LIST)."""
    return OPERATOR_ACL_7 if redis_major(admin) >= 7 else OPERATOR_ACL


def reader_acl(admin: redis.Redis) -> str:
    return READER_ACL_7 if redis_major(admin) >= 7 else READER_ACL


@pytest.fixture
def acl_users(redis_server_factory: Callable[..., RedisProcess]) -> tuple[str, str, str]:
    """(admin, engine user, operator user) URLs of a private server; the admin's steps
    done (the library loaded, expiry events on)."""
    server = redis_server_factory(port="auto")
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    line = engine_acl(admin).format(password="eng-Pw_1", ns="default")
    admin.execute_command(*line.split())
    line = operator_acl(admin).replace("PASSWORD", "op-Pw_2").replace("NAMESPACE", "default")
    admin.execute_command(*line.split())
    load_functions(admin)
    admin.config_set("notify-keyspace-events", "Ex")
    admin.close()
    base = f"127.0.0.1:{server.port}"
    return (
        server.tcp_url,
        f"redis://kvstate-engine:eng-Pw_1@{base}",
        f"redis://kvstate-operator:op-Pw_2@{base}",
    )


def test_engine_user_degrades_operator_user_does_it_all(acl_users: tuple[str, str, str]) -> None:
    admin, engine, operator = acl_users
    store = kvstate.connect(engine)
    p, d, snd, rcv = live_room(store, 131)
    doc = json.loads(run("--url", engine, "doctor", "--json", "--no-ucx").stdout)
    acl = next(c for c in doc["checks"] if c["name"] == "acl")
    assert doc["ok"] is True and acl["state"] == "warn", acl
    assert "kvstate-engine" in acl["detail"] and "XREVRANGE" in acl["detail"]
    assert "ACL SETUSER kvstate-operator" in acl["detail"]
    result = run("--url", engine, "audit")
    assert result.exit_code == 0, result.output
    assert "XREVRANGE" in result.output and "CONFIG" not in result.output
    store.client.hdel(store.keys.room_hash(131), "rx:decode-b.tp0")
    result = run("--url", engine, "audit", "--fix", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0, result.output
    assert [f["kind"] for f in doc["findings"]] == ["unindexed"] and doc["fixed"] == 1
    assert any("XADD" in n for n in doc["notes"])
    # the operator line in docs/security.md (and printed by doctor) is enough for every tool
    result = run("--url", operator, "doctor", "--json", "--no-ucx")
    acl = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "acl")
    assert result.exit_code == 0 and acl["state"] == "ok", acl
    result = run("--url", operator, "audit", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["notes"] == [], result.output
    for args in (
        ["show", "131"],
        ["ls"],
        ["engines"],
        ["top", "--once"],
        ["monitor", "--duration", "300ms", "--interval", "100ms"],
    ):
        result = run("--url", operator, *args)
        assert result.exit_code == 0, (args, result.output)
    result = run("--url", operator, "monitor", "--duration", "300ms", "--interval", "100ms")
    assert "expiry notifications on" in result.output
    p.close()
    d.close()
    store.close()


def test_operator_acl_line_is_in_the_security_doc() -> None:
    assert OPERATOR_ACL in SECURITY_DOC.read_text()
    assert READER_ACL in SECURITY_DOC.read_text()
    text = " ".join(SECURITY_DOC.read_text().split())
    assert "on 7.x add `+fcall +function|list`" in text  # OPERATOR_ACL_7
    assert "On 7.x add `+function|list`" in text  # READER_ACL_7
    for line in (OPERATOR_ACL_7, READER_ACL_7):
        assert "config" not in line.lower()


def test_read_only_operator_reads_everything_with_read_commands(
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    """docs/security.md's reader line allows no command that writes (COMMAND INFO says so);
    as that user, ls, show, top, engines and audit answer in full: no ACL refusal (they
    used to SCRIPT LOAD first), no degraded check, nothing in the server's ACL LOG."""
    server = redis_server_factory(port="auto")
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    line = reader_acl(admin).replace("PASSWORD", "rd-Pw_3").replace("NAMESPACE", "default")
    admin.execute_command(*line.split())
    allowed = {t[1:].partition("|")[0] for t in line.split() if t.startswith("+")}
    writes = {c.decode() for c in admin.execute_command("ACL", "CAT", "write")}
    assert allowed and not allowed & writes, allowed & writes
    for attempt in (  # what a write would take (ACL DRYRUN: Redis 7+)
        ["SET", "kvstate:default:x", "1"],
        ["HSET", "kvstate:default:x", "f", "1"],
        ["SCRIPT", "LOAD", "return 1"],
        ["EVAL", "return 1", "0"],
        ["CONFIG", "SET", "maxmemory", "1"],
        ["XADD", "kvstate:default:ledger", "*", "f", "1"],
    ):
        try:
            answer = admin.execute_command("ACL", "DRYRUN", "kvstate-reader", *attempt)
        except redis.ResponseError as exc:
            assert "unknown subcommand" in str(exc).lower() or "DRYRUN" in str(exc), exc
            break  # Redis 6.2: no DRYRUN
        assert answer != b"OK", attempt
    store = kvstate.connect(server.tcp_url, options=kvstate.Options(trace_rate=1.0))
    p, d, snd, rcv = live_room(store, 141)
    Ledger(store).append([Entry("test", None, "", "", "", None, "")])
    admin.execute_command("ACL", "LOG", "RESET")
    reader = f"redis://kvstate-reader:rd-Pw_3@127.0.0.1:{server.port}"
    for args in (
        ["ls"],
        ["ls", "--json"],
        ["show", "141"],
        ["show", "141", "--json"],
        ["top", "--once"],
        ["top", "--json"],
        ["engines"],
        ["engines", "--json"],
        ["audit"],
        ["trace", "141"],
        ["trace", "141", "--json"],
    ):
        result = run("--url", reader, *args)
        assert result.exit_code == 0, (args, result.output)
        assert "ACL" not in result.output and "note:" not in result.output, (args, result.output)
    doc = json.loads(run("--url", reader, "audit", "--json").stdout)
    assert doc["clean"] and doc["notes"] == [] and doc["ledger"], doc
    assert json.loads(run("--url", reader, "ls", "--json").stdout)["count"] == 2
    log = admin.execute_command("ACL", "LOG")
    assert log == [], log  # nothing was refused
    p.close()
    d.close()
    store.close()
    admin.close()


def test_interval_floor(redis_url: str) -> None:
    for args in (
        ["top", "--interval", "0"],
        ["top", "--interval", "50ms"],
        ["monitor", "--interval", "0"],
        ["top", "--interval", "-1"],
    ):
        result = run("--url", redis_url, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "--interval" in result.output


def test_long_engine_names_are_not_cut_at_80_columns(store: Store, redis_url: str) -> None:
    names = [f"prefill-node-with-a-long-hostname-0042.tp{i}" for i in (0, 1)]
    mgrs = [kvstate.KVManager(store, "prefill", n, f"10.0.0.9:{i}") for i, n in enumerate(names)]
    for m in mgrs:
        m.sender(7).poll()
    for args in (["ls"], ["engines"], ["show", "7"]):
        result = run("--url", redis_url, *args, env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert max(len(line) for line in lines) <= 80
        head = next(i for i, line in enumerate(lines) if re.search(r"\bengine\b", line))
        found = re.search(r"\bengine\s+", lines[head])
        assert found is not None
        start, end = found.start(), found.end()  # to where the next column starts
        # the engine column read down: both names whole (wrapped, never cut)
        column = "".join(line[start:end].strip() for line in lines[head + 1 :])
        assert names[0] + names[1] in column, result.output
    for m in mgrs:
        m.close()


# --------------------------------------------------------------------------- issue 21, item 5


def test_engines_show_rooms_in_flight_by_side_and_status(store: Store, redis_url: str) -> None:
    """The census `top` counts, per engine: what a router needs to pick engines."""
    p, d, snd, rcv = live_room(store, 151)
    snd2, rcv2 = p.sender(152), d.receiver(152, ADDR)
    rcv2.init(np.arange(8))
    assert snd2.poll() == KVPoll.WaitingForInput
    p.sender(153).poll()  # a sender alone: Bootstrapping
    rcv.abort("gone")  # room 151 fails, both sides: not in flight any more
    try:
        doc = json.loads(run("--url", redis_url, "engines", "--json").stdout)
        load = {e["engine"]: e["inflight"] for e in doc["engines"]}
        assert load["prefill-a.tp0"] == {
            "total": 2,
            "by_status": {"tx:Bootstrapping": 1, "tx:WaitingForInput": 1},
        }, load
        assert load["decode-b.tp0"] == {"total": 1, "by_status": {"rx:WaitingForInput": 1}}
        table = run("--url", redis_url, "engines").output
        assert "2: tx Bootstrapping 1, tx WaitingForInput 1" in table, table
        assert "1: rx WaitingForInput 1" in table, table
    finally:
        p.close()
        d.close()
