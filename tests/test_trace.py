"""The room trace (issue 21): every transition of every participant in the room's capped
stream, on the Redis server's clock, kept after clear() with its own TTL, sampled per
room id; ``kvstate trace ROOM`` and ``show``'s pointer to it. Real redis-server, on a
standalone server and on a 3-primary Cluster."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import kvstate
from kvstate import schema
from kvstate.cli import main
from kvstate.errors import InvalidOptionError, InvalidURLError
from kvstate.ops import reads
from kvstate.ops.audit import Auditor
from kvstate.ops.timeline import read_timeline
from kvstate.poll import KVPoll
from kvstate.store import Store
from kvstate.trace import TraceEntry, sampled
from tests.helpers import PREFILL_ADDR, assert_every_key_has_ttl, keys_of, room_keys, wait_for

ALL = kvstate.Options(trace_rate=1.0)
NONE = kvstate.Options(trace_rate=0.0)
NAMESPACE = "tr"  # of the ``store`` fixture (tests/conftest.py)
OPTIONS = ALL  # ``store`` traces every room
CHECK_TTL = True  # every key, traces included, has a TTL after each test (rule 1)


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def entries(store: Store, room: int) -> list[TraceEntry]:
    return read_timeline(store, room).entries


def steps(store: Store, room: int) -> list[tuple[str, str, str]]:
    return [(e.side, e.engine, e.event) for e in entries(store, room)]


def lifecycle(
    store: Store, room: int, p: kvstate.KVManager, d: kvstate.KVManager, clear: bool = True
) -> None:
    snd = p.sender(room, required_receivers=1)
    rcv = d.receiver(room, bootstrap_addr=PREFILL_ADDR)
    assert snd.poll() == KVPoll.Bootstrapping
    assert rcv.init(np.arange(4)) == KVPoll.WaitingForInput
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    assert rcv.poll() == KVPoll.Success
    if clear:
        snd.clear()
        rcv.clear()


def pair(store: Store) -> tuple[kvstate.KVManager, kvstate.KVManager]:
    p = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR)
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998")
    return p, d


TX, RX = ("tx", "prefill-a.tp0"), ("rx", "decode-b.tp0")
FULL = [
    (*TX, "created"),
    (*RX, "created"),
    (*RX, "bound"),
    (*RX, "published"),
    (*TX, "WaitingForInput"),
    (*RX, "WaitingForInput"),
    (*TX, "Transferring"),
    (*TX, "Success"),
    (*RX, "Success"),
    (*TX, "cleared"),
    (*RX, "cleared"),
]


def test_full_lifecycle_traces_every_transition_in_order(store: Store) -> None:
    """Every transition of both sides, in the order they happened, each stamped by the
    server clock: between two TIME readings of the server, in order."""
    p, d = pair(store)
    before = store.server_time_ms()
    lifecycle(store, 42, p, d)
    after = store.server_time_ms()
    got = entries(store, 42)
    assert [(e.side, e.engine, e.event) for e in got] == FULL
    assert all(before <= e.ms <= after for e in got), (before, [e.id for e in got], after)
    assert [(e.ms, e.seq) for e in got] == sorted((e.ms, e.seq) for e in got)
    created = got[0]
    assert created.fields[schema.STATUS] == "Bootstrapping"
    bound = got[2]
    assert bound.fields[schema.TRACE_PEER] == "prefill-a.tp0"
    assert bound.fields[schema.INCARNATION] == p.incarnation  # the peer's incarnation
    p.close()
    d.close()


def test_abort_and_failures_with_their_reasons(store: Store, store_url: str) -> None:
    """An abort (here by a process that does not sample the room: it appends to the
    trace the engines keep) fails each participant with its reason and the status it
    had; a participant created after it starts Failed; a bootstrap timeout and a begin
    into a failed receiver are Failed with their reasons."""
    p, d = pair(store)
    snd = p.sender(7, required_receivers=1)
    rcv = d.receiver(7, bootstrap_addr=PREFILL_ADDR)
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    other = kvstate.connect(store_url, namespace="tr", options=NONE)
    assert other.abort(7, "router cancelled") == 2
    aborts = [e for e in entries(store, 7) if e.event == "abort"]
    assert {(e.side, e.fields[schema.TRACE_WAS]) for e in aborts} == {
        ("tx", "WaitingForInput"),
        ("rx", "WaitingForInput"),
    }
    assert all(e.fields[schema.REASON] == "router cancelled" for e in aborts)
    late = kvstate.KVManager(store, "decode", "decode-c.tp0", "10.0.0.3:8998")
    assert late.receiver(7, bootstrap_addr=PREFILL_ADDR).poll() == KVPoll.Failed
    last = entries(store, 7)[-1]
    assert (last.engine, last.event, last.fields[schema.STATUS]) == (
        "decode-c.tp0",
        "created",
        "Failed",
    )
    assert last.fields[schema.REASON] == "router cancelled"
    # an abort of a room nobody traces writes no trace
    assert not sampled(8, 0.0)
    other.abort(8, "nobody traces this")  # RPUSHX: no trace started
    assert store.keys.trace(8) not in keys_of(store, traces=True)

    # a bootstrap timeout, on the server clock
    slow = kvstate.KVManager(
        store, "prefill", "prefill-b.tp0", "10.0.0.4:8998", bootstrap_timeout=0.05
    )
    slow_snd = slow.sender(9, required_receivers=1)
    assert slow_snd.poll() in (KVPoll.Bootstrapping, KVPoll.Failed)
    assert wait_for(lambda: slow_snd.poll() == KVPoll.Failed, 5.0)
    failed = [e for e in entries(store, 9) if e.event == "Failed"]
    assert len(failed) == 1 and "bootstrap timeout" in failed[0].fields[schema.REASON]

    # a sender that begins into a failed receiver fails with the receiver's reason
    snd2 = p.sender(10, required_receivers=1)
    rcv2 = d.receiver(10, bootstrap_addr=PREFILL_ADDR)
    rcv2.init(np.arange(4))
    assert snd2.poll() == KVPoll.WaitingForInput
    store.execute([store.update(10, "rx", "decode-b.tp0", KVPoll.Failed, "pages lost")])
    assert snd2.begin_transfer() == KVPoll.Failed
    tail = [(e.side, e.event, e.fields.get(schema.REASON, "")) for e in entries(store, 10)][-2:]
    assert tail[0] == ("rx", "Failed", "pages lost")
    assert tail[1][:2] == ("tx", "Failed") and "pages lost" in tail[1][2]
    for m in (p, d, late, slow):
        m.close()
    other.close()


def test_failures_decided_by_the_mark_are_traced_with_its_reason(store: Store) -> None:
    """The room's failure mark (issue 17) fails participants that did not fail
    themselves: a begin or finish refused because the room failed, and a Success that
    a poll fails. Each is a Failed entry of that participant with the mark's reason."""
    p, d = pair(store)
    third = kvstate.KVManager(store, "decode", "decode-c.tp0", "10.0.0.3:8998")

    def fail_third(room: int, reason: str) -> None:
        assert third.receiver(room, bootstrap_addr=PREFILL_ADDR).poll() == KVPoll.Bootstrapping
        store.execute([store.update(room, "rx", "decode-c.tp0", KVPoll.Failed, reason)])

    def last_of(room: int, side: str) -> tuple[str, str, str]:
        e = [e for e in entries(store, room) if e.side == side][-1]
        return (e.engine, e.event, e.fields.get(schema.REASON, ""))

    # begin refused by the mark (its own receiver is fine)
    snd = p.sender(20, required_receivers=1)
    d.receiver(20, bootstrap_addr=PREFILL_ADDR).init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    fail_third(20, "third lost its pages")
    assert snd.begin_transfer() == KVPoll.Failed
    assert last_of(20, "tx") == ("prefill-a.tp0", "Failed", "third lost its pages")

    # finish refused by the mark
    snd = p.sender(21, required_receivers=1)
    d.receiver(21, bootstrap_addr=PREFILL_ADDR).init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    fail_third(21, "third timed out")
    assert snd.finish_transfer() == KVPoll.Failed
    assert last_of(21, "tx") == ("prefill-a.tp0", "Failed", "third timed out")

    # a Success failed by a poll, once the room failed elsewhere
    snd = p.sender(22, required_receivers=1)
    rcv = d.receiver(22, bootstrap_addr=PREFILL_ADDR)
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    fail_third(22, "router gave up")
    assert rcv.poll() == KVPoll.Failed
    assert last_of(22, "rx") == ("decode-b.tp0", "Failed", "router gave up")
    mine = [e.event for e in entries(store, 22) if e.engine == "decode-b.tp0"]
    assert mine[-2:] == ["Success", "Failed"]
    for m in (p, d, third):
        m.close()


def test_bad_input_writes_no_trace_entry(store: Store) -> None:
    """A corrupt participant makes its script raise before anything is written, the
    trace included (design rule 7): the binding a publish was about to make is not
    traced."""
    p, d = pair(store)
    rcv = d.receiver(11, bootstrap_addr="10.9.9.9:1")  # no engine there: nothing bound
    assert rcv.poll() == KVPoll.Bootstrapping
    before = steps(store, 11)
    assert before == [(*RX, "created")]
    store.client.hset(store.keys.participant(11, "rx", "decode-b.tp0"), "peers", "x")
    call = store.publish(11, "decode-b.tp0", {"prefill-a.tp0": p.incarnation}, b"i", 1)
    with pytest.raises(kvstate.CorruptStateError):
        store.execute([call])
    assert steps(store, 11) == before
    p.close()
    d.close()


def test_trace_outlives_clear_with_its_ttl(store_url: str) -> None:
    """clear() deletes the room's state but not its trace, which keeps its own TTL
    (design rule 1 holds: every key has one); the audit reports nothing; the trace
    goes when its TTL runs out."""
    store = kvstate.connect(
        store_url, namespace="tr", options=kvstate.Options(trace_rate=1.0, trace_ttl=30.0)
    )
    p, d = pair(store)
    lifecycle(store, 42, p, d)
    key = store.keys.trace(42)
    assert keys_of(store, store.keys.room_prefix(42) + "*", traces=True) == [key]
    assert room_keys(store, 42) == []  # what "no key left" means: the trace is kept
    assert 0 < int(store.execute([reads.ttl_of(key)])[0]) <= 30_000
    assert_every_key_has_ttl(store)
    report = Auditor(store, grace=0.0).run()
    assert [f.key for f in report.findings if key in f.key] == []
    p.close()
    d.close()
    short = kvstate.connect(
        store_url, namespace="tr", options=kvstate.Options(trace_rate=1.0, trace_ttl=1.0)
    )
    p, d = pair(short)
    lifecycle(short, 43, p, d)
    assert wait_for(lambda: not keys_of(short, short.keys.trace(43), traces=True), 10.0)
    for m in (p, d):
        m.close()
    store.close()
    short.close()


def test_sampling_zero_writes_nothing_one_writes_everything(store_url: str) -> None:
    off = kvstate.connect(store_url, namespace="tr", options=NONE)
    p, d = pair(off)
    lifecycle(off, 42, p, d)
    assert keys_of(off, traces=True) == keys_of(off)  # no trace anywhere
    p.close()
    d.close()
    on = kvstate.connect(store_url, namespace="tr", options=ALL)
    p, d = pair(on)
    lifecycle(on, 42, p, d)
    assert steps(on, 42) == FULL
    p.close()
    d.close()
    off.close()
    on.close()


def test_both_sides_agree_on_sampling(store_url: str) -> None:
    """Each side on its own connection, at the same rate: a room is traced by both
    sides or by neither, with no coordination; a rate's rooms are also traced at any
    higher rate, and the share is the rate."""
    rate = 0.3
    opts = kvstate.Options(trace_rate=rate)
    tx_store = kvstate.connect(store_url, namespace="tr", options=opts)
    rx_store = kvstate.connect(store_url, namespace="tr", options=opts)
    p = kvstate.KVManager(tx_store, "prefill", "prefill-a.tp0", PREFILL_ADDR)
    d = kvstate.KVManager(rx_store, "decode", "decode-b.tp0", "10.0.0.2:8998")
    rooms = range(1000, 1030)
    for room in rooms:
        lifecycle(tx_store, room, p, d)
    for room in rooms:
        got = steps(tx_store, room)
        assert got == (FULL if sampled(room, rate) else []), (room, got)
    assert 0 < sum(sampled(r, rate) for r in rooms) < len(rooms)
    picked = [r for r in range(100_000) if sampled(r, 0.01)]
    assert 900 <= len(picked) <= 1100  # 1% of the ids, consecutive ids included
    assert all(sampled(r, 0.05) for r in picked)
    p.close()
    d.close()
    tx_store.close()
    rx_store.close()


def test_trace_options_are_checked(redis_url: str) -> None:
    for bad in (-0.1, 1.5, "1", True):
        with pytest.raises(InvalidOptionError, match="trace_rate"):
            kvstate.Options(trace_rate=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="trace_ttl"):
        kvstate.Options(trace_ttl=0)
    for query in ("trace_rate=2", "trace_rate=x", "trace_ttl=0"):
        with pytest.raises(InvalidURLError, match=query.partition("=")[0]):
            kvstate.connect(f"{redis_url}?{query}")
    store = kvstate.connect(f"{redis_url}?trace_rate=0.5&trace_ttl=60", options=NONE)
    assert (store.options.trace_rate, store.options.trace_ttl) == (0.5, 60.0)
    store.close()


def test_entries_are_json_readable_with_redis_cli(store: Store) -> None:
    """One JSON object per entry, as LRANGE shows it; the server clock in ``ms``."""
    p, d = pair(store)
    lifecycle(store, 42, p, d)
    raw = store.client.lrange(store.keys.trace(42), 0, -1)
    first = json.loads(raw[0])
    assert first["side"] == "tx" and first["engine"] == "prefill-a.tp0"
    assert first["event"] == "created" and first["status"] == "Bootstrapping"
    assert isinstance(first["ms"], int) and first["ms"] > 1_600_000_000_000
    p.close()
    d.close()


def test_cli_trace_table_json_and_empty(store: Store, store_url: str) -> None:
    p, d = pair(store)
    lifecycle(store, 42, p, d)
    url = store_url
    result = run("--url", url, "-n", "tr", "trace", "42")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("room 42  namespace tr  trace expires in ")
    assert lines[1].split() == [
        "server",
        "time",
        "(UTC)",
        "+ms",
        "at",
        "ms",
        "side",
        "engine",
        "event",
        "detail",
    ]
    rows = [line.split() for line in lines[2:-1]]
    at = [next(i for i, word in enumerate(r) if word in ("tx", "rx")) for r in rows]
    assert [tuple(r[i : i + 3]) for r, i in zip(rows, at, strict=True)] == FULL
    assert f"peer prefill-a.tp0@{p.incarnation}" in result.output
    summary = lines[-1]
    assert summary.startswith("room 42: Success; ")
    for phase in ("bootstrap", "waiting for input", "transfer", "until clear"):
        assert f"{phase} " in summary, summary
    assert summary.endswith(f"; {len(FULL)} steps")

    doc = json.loads(run("--url", url, "-n", "tr", "trace", "42", "--json").stdout)
    assert doc["room"] == 42 and doc["outcome"] == "Success" and doc["namespace"] == "tr"
    assert [(s["side"], s["engine"], s["event"]) for s in doc["steps"]] == FULL
    assert doc["steps"][0]["delta_ms"] is None
    assert sum(s["delta_ms"] for s in doc["steps"][1:]) == doc["total_ms"]
    assert [ph["name"] for ph in doc["phases"]] == [
        "bootstrap",
        "waiting for input",
        "transfer",
        "until clear",
    ]
    assert sum(ph["ms"] for ph in doc["phases"]) == doc["total_ms"]
    assert 0 < doc["ttl_ms"] <= 3_600_000

    empty = run("--url", url, "-n", "tr", "trace", "43")
    assert empty.exit_code == 1, empty.output
    assert "no trace: room not sampled or trace expired; sampling rate is 0.01" in empty.output
    doc = json.loads(run("--url", url, "-n", "tr", "trace", "43", "--json").stdout)
    assert doc["steps"] == [] and doc["outcome"] is None and doc["trace_rate"] == 0.01
    bad = run("--url", url, "trace", "4_2")
    assert bad.exit_code == 2 and "ASCII digits" in bad.output
    p.close()
    d.close()


def test_cli_trace_of_a_failed_room_names_the_failure(redis_url: str) -> None:
    store = kvstate.connect(redis_url, options=ALL)
    p, d = pair(store)
    snd = p.sender(5, required_receivers=1)
    rcv = d.receiver(5, bootstrap_addr=PREFILL_ADDR)
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    rcv.abort("decode preempted")
    t = read_timeline(store, 5)
    assert t.outcome == "Failed: decode preempted (by rx:decode-b.tp0)"
    # not cleared yet: live, in its clear phase, which runs to now (issue 31)
    assert [(ph.name, ph.open) for ph in t.phases()] == [
        ("bootstrap", False),
        ("waiting for input", False),
        ("transfer until failure", False),
        ("until clear", True),
    ]
    result = run("--url", redis_url, "trace", "5")
    assert result.exit_code == 0, result.output
    assert "decode preempted" in result.output and "was Transferring" in result.output
    assert "room 5: Failed: decode preempted (by rx:decode-b.tp0); " in result.output
    p.close()
    d.close()
    store.close()


def test_cli_trace_of_a_live_room_runs_its_open_phase_to_now(store: Store, store_url: str) -> None:
    """Issue 31: a room waiting 28 s read "4 ms from first to last step". The phase it is
    in runs to the server's current time, marked "so far"; once both sides cleared, the
    timeline ends at its last step again."""
    p, d = pair(store)
    snd = p.sender(61, required_receivers=1)
    rcv = d.receiver(61, bootstrap_addr=PREFILL_ADDR)
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput  # the prefill "computes": no transfer yet
    last = entries(store, 61)[-1].ms
    assert wait_for(lambda: store.server_time_ms() >= last + 300, 10)  # the server's clock
    now = store.server_time_ms()
    first = entries(store, 61)[0].ms
    result = run("--url", store_url, "-n", "tr", "trace", "61")
    assert result.exit_code == 0, result.output
    summary = result.output.strip().splitlines()[-1]
    assert summary.startswith("room 61: in flight; ") and "so far" in summary, summary
    doc = json.loads(run("--url", store_url, "-n", "tr", "trace", "61", "--json").stdout)
    assert doc["live"] is True and doc["now_ms"] >= now
    assert doc["total_ms"] >= now - first >= 300
    *done, current = doc["phases"]
    assert [ph["name"] for ph in done] == ["bootstrap"] and not done[0]["open"]
    assert current["name"] == "waiting for input" and current["open"] is True
    assert current["to_ms"] == doc["now_ms"] and current["ms"] >= now - last
    assert re.search(r"waiting for input \d+ ms so far; 5 steps$", summary), summary
    assert sum(ph["ms"] for ph in doc["phases"]) == doc["total_ms"]
    snd.begin_transfer()
    snd.finish_transfer()
    rcv.poll()
    snd.clear()
    rcv.clear()
    doc = json.loads(run("--url", store_url, "-n", "tr", "trace", "61", "--json").stdout)
    assert doc["live"] is False and doc["now_ms"] is None
    assert not any(ph["open"] for ph in doc["phases"])
    assert doc["total_ms"] == doc["steps"][-1]["ms"] - doc["steps"][0]["ms"]
    p.close()
    d.close()


def test_show_points_to_the_trace(store_url: str) -> None:
    store = kvstate.connect(store_url, namespace="tr", options=ALL)
    p, d = pair(store)
    lifecycle(store, 42, p, d, clear=False)
    result = run("--url", store_url, "-n", "tr", "show", "42")
    assert result.exit_code == 0, result.output
    assert "trace: kvstate trace 42" in result.output
    assert json.loads(run("--url", store_url, "-n", "tr", "show", "42", "--json").stdout)["traced"]
    for m in (p, d):
        m.clear_many(m.live_rooms)
    result = run("--url", store_url, "-n", "tr", "show", "42")
    assert result.exit_code == 1
    assert "nothing stored" in result.output
    assert "its trace is kept: kvstate trace 42" in result.output
    # a room nobody traced: no pointer
    off = kvstate.connect(store_url, namespace="tr", options=NONE)
    for m in (p, d):
        m.close()
    p2, d2 = pair(off)
    lifecycle(off, 44, p2, d2, clear=False)
    result = run("--url", store_url, "-n", "tr", "show", "44")
    assert result.exit_code == 0 and "kvstate trace" not in result.output
    for m in (p2, d2):
        m.close()
    store.close()
    off.close()


def test_clear_at_maxmemory_still_clears_a_traced_room(redis_server_factory: Any) -> None:
    """At maxmemory a clear goes through without the transaction; the trace's entry
    (XADD takes memory) is left out, not the clear."""
    proc = redis_server_factory(port="auto")
    admin = proc.client()
    store = kvstate.connect(proc.unix_url, namespace="oom", options=ALL)
    p, d = pair(store)
    lifecycle(store, 1, p, d, clear=False)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        for m in (p, d):
            m.clear_many(m.live_rooms)
        assert room_keys(store, 1) == []
        assert keys_of(store, store.keys.trace(1), traces=True) == [store.keys.trace(1)]
        assert steps(store, 1)[-1][2] == "Success"  # no cleared entry: no memory for it
    finally:
        admin.config_set("maxmemory", "0")
    for m in (p, d):
        m.close()
    store.close()
    admin.close()
