"""Operator views survive hostile keys, and every command bounds its output (issue 30,
items 5 and 8): a key of the wrong type, a corrupt value, a 1 MB reason, a 200k-entry
trace or a 20k-field hash is a finding or a row, and each command goes on, exits 0 or
1 (never 2 with nothing else reported), and prints a bounded amount, --json included,
with "... N more" where it cut. Run as a user would: the CLI through click's runner,
against a real redis-server."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from click.testing import CliRunner, Result

import kvstate
from kvstate.cli import main
from kvstate.ops.audit import Auditor
from kvstate.ops.metrics import Metrics
from kvstate.ops.monitor import Monitor
from kvstate.store import Store
from tests.helpers import wait_for

ADDR = "10.0.0.1:1"
TTL = 600_000


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server (the CLI below is given ``redis_url``)."""
    return redis_url


def run(url: str, *args: str) -> Result:
    result = CliRunner().invoke(main, ["--url", url, *args])
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not crashed, (args, result.exception, result.output[-2000:])
    assert result.exit_code in (0, 1), (args, result.exit_code, result.output[-2000:])
    return result


@pytest.fixture
def hostile(redis_url: str) -> Iterator[tuple[str, Store]]:
    """A namespace with a live room (1) and hostile keys beside it, each of a kind a view
    reads: a room hash that is a list (5) with a participant that is a string, a
    failure mark that is a string (6), traces that are a string (7) or hold non-JSON and
    out-of-range entries (8), a participant of corrupt numbers whose transfer info
    lists 2^31 pages (9), registrations that are a string or incomplete, an address
    index, tracker and counters that are strings, a ledger that is a hash, and a key
    without TTL (a real leak the audit must still find)."""
    store = kvstate.connect(redis_url)
    c, k = store.client, store.keys
    p = kvstate.KVManager(store, "prefill", "p0", ADDR, lease=600)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=600)
    snd, rcv = p.sender(1), d.receiver(1, ADDR)
    rcv.init(np.arange(4))
    snd.poll()
    c.rpush(k.room_hash(5), "x")
    c.set(k.participant(5, "tx", "p0"), "x")
    c.set(k.aborted(6), "a")
    c.hset(k.participant(6, "tx", "p0"), mapping={"status": "Failed", "created_ms": "1"})
    c.hset(k.room_hash(6), "tx:p0", "")
    c.set(k.trace(7), "x")
    c.rpush(k.trace(8), "not json", "[1, 2]", '{"ms": 1e999, "event": 5}', '{"ms": {}}')
    c.set(k.engine("evil"), "x")
    c.hset(k.engine("half"), "role", "prefill")
    c.set(k.engines_at("10.0.0.9:1"), "x")
    c.set(k.addr("10.0.0.9:1"), "x")
    c.set(k.transfer_stats("evil"), "x")
    c.hset(k.ledger, "a", "b")
    huge = np.array([[0, 2**31 - 1], [0, 1]], dtype="<i4").tobytes()
    c.hset(
        k.participant(9, "rx", "d0"),
        mapping={"status": "WaitingForInput", "created_ms": "-1", "peers": "nan", "bound": "1.5"},
    )
    c.hset(
        k.room_hash(9),
        mapping={
            "rx:d0": "",
            "xfer:p0,d0": msgpack.packb({"v": 1, "kv": huge, "inc": ""}),
            "ack:d0": "x" * 100,
        },
    )
    for key in store.scan(k.all_pattern):
        if store.client.pttl(key) == -1:
            c.pexpire(key, TTL)
    c.set("kvstate:default:stray", "1")  # no TTL: the audit's finding, hostile keys or not
    yield redis_url, store
    p.close()
    d.close()
    store.close()


WRONG_TYPED = [
    "kvstate:default:{5}:room",
    "kvstate:default:{5}:tx:p0",
    "kvstate:default:{6}:aborted",
    "kvstate:default:{7}:trace",
    "kvstate:default:engine:evil",
    "kvstate:default:engines_at:10.0.0.9:1",
    "kvstate:default:addr:10.0.0.9:1",
    "kvstate:default:stats:evil",
    "kvstate:default:ledger",
]


def test_audit_names_each_hostile_key_and_goes_on(hostile) -> None:
    """`audit` (text and --json) and Auditor.run(): a `corrupt` finding for each key of
    the wrong type and the participant of corrupt numbers, and the rest of the audit
    still done (the key without TTL found); --fix repairs what it can, leaves these."""
    url, store = hostile
    report = Auditor(store).run()
    corrupt = {f.key for f in report.findings if f.kind == "corrupt"}
    assert set(WRONG_TYPED) | {"kvstate:default:{9}:rx:d0"} <= corrupt, corrupt
    assert "kvstate:default:stray" in {f.key for f in report.findings if f.kind == "no_ttl"}
    numbers = next(f for f in report.findings if f.key == "kvstate:default:{9}:rx:d0")
    assert "peers" in numbers.detail and "created_ms" in numbers.detail, numbers.detail
    result = run(url, "audit", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and set(WRONG_TYPED) <= {f["key"] for f in doc["findings"]}
    assert any("ledger cannot be read" in n for n in doc["notes"]), doc["notes"]
    text = run(url, "audit").output
    assert all(key in text for key in WRONG_TYPED), text
    doc = json.loads(run(url, "audit", "--fix", "--json").stdout)
    left = {f["key"] for f in doc["findings"] if f["left"]}
    assert set(WRONG_TYPED) <= left
    assert store.client.pttl("kvstate:default:stray") > 0  # fixed: the audit went on


@pytest.mark.parametrize(
    "args",
    [
        ["engines"],
        ["engines", "--json"],
        ["top", "--once"],
        ["top", "--json"],
        ["ls"],
        ["ls", "--json"],
        ["show", "1"],
        ["show", "5"],
        ["show", "5", "--json"],
        ["show", "6"],
        ["show", "9"],
        ["show", "9", "--json"],
        ["trace", "7"],
        ["trace", "8", "--json"],
        ["doctor", "--no-ucx"],
    ],
    ids=" ".join,
)
def test_every_view_goes_on_past_hostile_keys(hostile, args: list[str]) -> None:
    """Each view shows what reads and names what does not (exit 0 or 1), where a
    registration that was a string made `engines` and `top` exit 2 listing nothing, a
    room hash that was a list made `show` exit 2, and a 2^31-page transfer info made
    `show` die with a numpy traceback."""
    url, _ = hostile
    result = run(url, *args)
    out = result.output
    if args[0] == "engines":
        assert "p0" in out and "d0" in out and "evil" in out and result.exit_code == 1
    if args[0] == "top":
        assert "corrupt" in out
    if args[:2] == ["show", "5"]:
        assert "kvstate:default:{5}:room: not a hash" in out
    if args[:2] == ["show", "9"]:
        assert "more than" in out  # the 2^31-page info: corrupt, not decoded


def test_abort_of_a_room_it_cannot_read_says_what_to_do(hostile) -> None:
    url, store = hostile
    before = store.client.type(store.keys.room_hash(5))
    result = CliRunner().invoke(main, ["--url", url, "abort", "5"])
    assert result.exit_code == 2 and "not a hash" in result.output, result.output
    assert "redis-cli DEL" in result.output and "nothing written" in result.output
    assert store.client.type(store.keys.room_hash(5)) == before


def test_monitor_sweeps_past_hostile_keys(hostile) -> None:
    """The monitor's sweep and metrics (registrations by role, transfer counters) read
    past a registration and counters that are strings."""
    _, store = hostile
    metrics = Metrics()
    mon = Monitor(store, 0.1, metrics=metrics)
    mon.start()
    mon.sweep()
    text = metrics.render().decode()
    assert 'kvstate_engines_alive{role="prefill"} 2.0' in text, text  # p0 and "half"
    assert 'kvstate_engines_alive{role="decode"} 1.0' in text, text
    mon.events.close()


# --------------------------------------------------------------------------- bounds


def test_a_megabyte_reason_is_cut(store: Store, redis_url: str) -> None:
    """A 1 MB reason: `show`, `ls` and `trace` print a bounded line, --json a bounded
    value, each saying how much was cut."""
    with (
        kvstate.KVManager(store, "prefill", "p0", ADDR) as p,
        kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1") as d,
    ):
        store.client.delete(store.keys.aborted(3))
        snd, rcv = p.sender(3), d.receiver(3, ADDR)
        rcv.init([1])
        snd.abort("r" * 1_000_000)
        for args in (["show", "3"], ["show", "3", "--json"], ["ls"], ["ls", "--json"]):
            out = run(redis_url, *args).output
            assert len(out) < 30_000, (args, len(out))
            assert "more chars" in out, args
        snd.clear()
        rcv.clear()


def test_a_200k_entry_trace_is_cut(store: Store, redis_url: str) -> None:
    """A trace of 200k entries (no room makes one): `trace` reads at most 10,000 and
    shows --limit of them (1000 by default) with "... N more", --json too, quickly."""
    key = store.keys.trace(4)
    entry = json.dumps({"ms": 1_700_000_000_000, "side": "tx", "engine": "p0", "event": "x"})
    pipe = store.client.pipeline(transaction=False)
    for _ in range(200):
        pipe.rpush(key, *([entry] * 1000))
    pipe.pexpire(key, TTL)
    pipe.execute()
    t0 = time.monotonic()
    out = run(redis_url, "trace", "4").output
    assert "... 199000 more steps" in out and out.count("\n") < 1100, out[-500:]
    doc = json.loads(run(redis_url, "trace", "4", "--json", "--limit", "10").stdout)
    assert len(doc["steps"]) == 10 and doc["steps_more"] == 199_990
    took = time.monotonic() - t0
    print(f"\n[bounds] trace of 200k entries, text and --json: {took:.1f} s")


def test_a_20k_field_hash_is_cut(store: Store, redis_url: str) -> None:
    """A participant hash of 20k fields (`ls --json` printed 1.1 MB for one) and a room
    hash of 20k members: --json objects carry at most 200 entries ("...": "N more"),
    `show` lists --limit participants."""
    with kvstate.KVManager(store, "prefill", "p0", ADDR) as p:
        snd = p.sender(2)
        snd.poll()
        store.client.hset(snd.key, mapping={f"junk{i}": "v" * 50 for i in range(20_000)})
        doc = json.loads(run(redis_url, "ls", "--json").stdout)
        fields = doc["participants"][0]["fields"]
        assert len(fields) == 201 and fields["..."].startswith("... 19"), len(fields)
        assert len(run(redis_url, "ls", "--json").stdout) < 60_000
        room = store.keys.room_hash(2)
        store.client.hset(room, mapping={f"tx:ghost{i}": "" for i in range(3000)})
        doc = json.loads(run(redis_url, "show", "2", "--json", "--limit", "50").stdout)
        assert len(doc["members"]) == 50 and doc["members_more"] == 2951
        out = run(redis_url, "show", "2", "--limit", "50").output
        assert out.count("participant hash is gone") == 50
        store.client.delete(room)
        snd.clear()


def test_audit_findings_are_cut_and_all_counted(store: Store, redis_url: str) -> None:
    pipe = store.client.pipeline(transaction=False)
    for i in range(3000):
        pipe.set(f"kvstate:default:stray{i}", "1")
    pipe.execute()
    out = run(redis_url, "audit", "--limit", "100").output
    assert "... 2900 more findings" in out and "3000 finding(s)" in out
    doc = json.loads(run(redis_url, "audit", "--json", "--limit", "100").stdout)
    assert len(doc["findings"]) == 100 and doc["findings_more"] == 2900 and doc["left"] == 3000


def test_an_evicted_registration_is_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A registration that vanished before its lease ran out (what an eviction under
    allkeys-lru does) is registered again by the heartbeat, and logged at WARNING
    from kvstate.registry, saying it may have been evicted."""
    caplog.set_level(logging.WARNING, logger="kvstate.registry")
    with kvstate.KVManager(store, "prefill", "p0", ADDR, lease=5.0, heartbeat_interval=0.05):
        key = store.keys.engine("p0")
        store.client.delete(key)  # what an eviction does
        assert wait_for(lambda: store.client.exists(key) == 1, 5.0)
        assert wait_for(
            lambda: any(
                r.levelno == logging.WARNING and "evicted" in r.getMessage()
                for r in caplog.records
                if r.name == "kvstate.registry"
            ),
            5.0,
        )
