"""The design rules (docs/design.md) on real Redis, standalone and a 3-primary Cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll, schema
from kvstate.keys import TRACKER_SHARDS, Keys
from kvstate.store import Store
from kvstate.testing import RedisCluster
from tests.helpers import (
    PREFILL_ADDR,
    assert_every_key_has_ttl,
    keys_of,
    managers,
    room_keys,
    scaled,
    wait_for,
)

NAMESPACE = "t"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


def lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int) -> tuple:
    snd = p.sender(room)
    rcv = d.receiver(room, PREFILL_ADDR)
    assert rcv.init(np.arange(40, 104)) == KVPoll.WaitingForInput
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    assert rcv.poll() == KVPoll.Success
    return snd, rcv


def _fields(store: Store, room: int) -> dict[str, str]:
    raw = store.client.hgetall(store.keys.room_hash(room))
    return {k.decode(): v.decode("latin-1") for k, v in raw.items()}


@pytest.mark.parametrize("first", ["tx", "rx"])
def test_a_room_is_three_keys_and_its_clears_leave_none(store: Store, first: str) -> None:
    """docs/design.md, Data model: a room held in WaitingForInput is its two participant
    hashes and one room hash (both members and the transfer info), nothing else; the
    ack joins the room hash; each side's clear takes its own fields of it, and once
    both cleared no room key is left (the tracker's member gone too), in either order."""
    p, d = managers(store)
    k = store.keys
    with p, d:
        snd, rcv = p.sender(43), d.receiver(43, PREFILL_ADDR)
        tx, rx = schema.member("tx", p.engine), schema.member("rx", d.engine)
        xfer, ack = schema.xfer_field(p.engine, d.engine), schema.ack_field(d.engine)
        assert rcv.init(np.arange(8)) == KVPoll.WaitingForInput
        assert snd.poll() == KVPoll.WaitingForInput
        assert room_keys(store, 43, marks=True) == sorted([snd.key, rcv.key, k.room_hash(43)])
        assert sorted(_fields(store, 43)) == sorted([tx, rx, xfer])
        tracked = store.client.zrange(k.tracker(PREFILL_ADDR, 43), 0, -1)
        assert tracked == [f"43 {d.engine}".encode()]  # Keys.tracker_member
        assert k.tracked_key(tracked[0].decode()) == rcv.key
        assert 0 < store.client.pttl(k.room_hash(43)) <= 900_000
        assert snd.begin_transfer() == KVPoll.Transferring
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        assert _fields(store, 43)[ack] == p.engine
        assert room_keys(store, 43, marks=True) == sorted([snd.key, rcv.key, k.room_hash(43)])
        (snd if first == "tx" else rcv).clear()  # the info goes with either side
        assert set(_fields(store, 43)) == ({tx} if first == "rx" else {rx, ack})
        (rcv if first == "tx" else snd).clear()
        assert room_keys(store, 43, marks=True) == []
        assert not store.client.zrange(k.tracker(PREFILL_ADDR, 43), 0, -1)


def test_a_failed_room_leaves_only_its_mark(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(44), d.receiver(44, PREFILL_ADDR)
        rcv.init(np.arange(8))
        assert snd.poll() == KVPoll.WaitingForInput
        snd.abort("boom")
        assert rcv.poll() == KVPoll.Failed
        snd.clear()
        rcv.clear()
        assert room_keys(store, 44, marks=True) == [store.keys.aborted(44)]


def test_full_lifecycle_leaves_nothing(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = lifecycle(p, d, 7)
        assert room_keys(store, 7)  # the room really was in Redis
        assert_every_key_has_ttl(store)
        snd.clear()
        rcv.clear()
        assert room_keys(store, 7) == []
        assert not store.client.zrange(store.keys.tracker(PREFILL_ADDR, 7), 0, -1)
        snd.clear()  # clear twice is fine
        rcv.clear()
    assert keys_of(store) == []  # close() dropped both leases


def test_sender_created_after_receiver_published(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(1, PREFILL_ADDR)
        rcv.init([5, 6, 7])
        snd = p.sender(1)
        assert snd.poll() == KVPoll.WaitingForInput
        assert snd.transfer_infos()["decode-b.tp0"].kv_indices.tolist() == [5, 6, 7]
        snd.clear()
        rcv.clear()
        assert room_keys(store, 1) == []


def test_late_updates_after_clear_create_nothing(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = lifecycle(p, d, 9)
        snd.clear()
        rcv.clear()
        s = store
        late = [
            s.update(9, "tx", p.engine, KVPoll.Transferring),
            s.update(9, "rx", d.engine, KVPoll.Failed, "late"),
            s.poll(9, "rx", d.engine),
            s.publish(9, d.engine, {p.engine: p.incarnation}, b"x"),
            s.finish(9, p.engine, [d.engine]),
            s.poll(9, "tx", p.engine),
        ]
        for reply in s.execute(late):
            assert reply.status is None  # "found nothing"
        assert room_keys(store, 9) == []
        # the participant objects do not come back either
        assert snd.poll() == KVPoll.Success and rcv.poll() == KVPoll.Success
        assert room_keys(store, 9) == []


def test_clear_of_state_already_gone_never_raises(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(3)
        snd.clear()  # never created
        rcv = d.receiver(4, PREFILL_ADDR)
        rcv.init([1])
        for key in room_keys(store, 4):
            store.client.delete(key)  # expired / deleted by someone else
        assert rcv.poll() == KVPoll.Failed
        assert "state lost" in rcv.failure_exception().reason  # and clears
        rcv.clear()
        assert room_keys(store, 4) == []


@pytest.mark.parametrize("later", list(KVPoll))
def test_failed_is_sticky(store: Store, later: KVPoll) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(11)
        snd.poll()
        assert snd.fail("first reason") == KVPoll.Failed
        reply = store.execute([store.update(11, "tx", p.engine, later, "second reason")])[0]
        assert reply.status == KVPoll.Failed
        assert reply.reason == "first reason"
        assert snd.finish_transfer() == KVPoll.Failed
        snd.clear()


def test_status_only_moves_forward_and_success_only_yields_to_abort(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = lifecycle(p, d, 12)
        for status in (KVPoll.Bootstrapping, KVPoll.Transferring, KVPoll.Failed):
            assert store.execute([store.update(12, "tx", p.engine, status)])[0].status == (
                KVPoll.Success
            )
        snd.abort("operator said so")
        assert rcv.poll() == KVPoll.Failed
        assert "operator said so" in rcv.failure_exception().reason
        assert snd.poll() == KVPoll.Failed
        snd.clear()
        assert room_keys(store, 12) == []


def test_abort_reaches_the_other_side(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(13)
        rcv = d.receiver(13, PREFILL_ADDR)
        rcv.init([1, 2])
        assert snd.poll() == KVPoll.WaitingForInput
        rcv.abort("client went away")
        assert snd.poll() == KVPoll.Failed
        exc = snd.failure_exception()
        assert isinstance(exc, kvstate.KVTransferError) and "client went away" in exc.reason
        rcv.clear()
        assert room_keys(store, 13) == []


def test_timeouts_use_the_server_clock(store: Store) -> None:
    p, d = managers(store, bootstrap_timeout=0.2, waiting_timeout=0.3)
    with p, d:
        snd = p.sender(21)
        rcv = d.receiver(22, PREFILL_ADDR)
        assert snd.poll() == KVPoll.Bootstrapping
        rcv.init([1])
        assert wait_for(lambda: snd.poll() == KVPoll.Failed, 5.0)
        assert "bootstrap timeout" in snd.failure_exception().reason
        assert wait_for(lambda: rcv.poll() == KVPoll.Failed, 5.0)
        assert "waiting timeout" in rcv.failure_exception().reason


def test_default_timeouts_are_not_stored_and_still_apply(store: Store) -> None:
    """A participant with kvstate's default timeouts stores none (they are poll.lua's
    F_DEFAULT_TIMEOUTS_MS), and its poll still fails it past them; other timeouts are
    stored."""
    p, d = managers(store)
    other = kvstate.KVManager(store, "prefill", "prefill-c.tp0", "10.0.0.3:8998", waiting_timeout=7)
    with p, d, other:
        snd, custom = p.sender(23), other.sender(24)
        rcv = d.receiver(23, PREFILL_ADDR)
        assert snd.poll() == KVPoll.Bootstrapping and custom.poll() == KVPoll.Bootstrapping
        assert rcv.poll() == KVPoll.Bootstrapping
        for key in (snd.key, rcv.key):
            assert store.client.hget(key, schema.TIMEOUTS_MS) is None, key
        assert store.client.hget(custom.key, schema.TIMEOUTS_MS) == b"300000 7000"
        bootstrap_ms = schema.timeouts_of({})[0]
        now = int(store.client.time()[0]) * 1000
        store.client.hset(snd.key, schema.CREATED_MS, now - bootstrap_ms - 5_000)
        assert snd.poll() == KVPoll.Failed
        reason = snd.failure_exception().reason
        assert "bootstrap timeout" in reason and f"limit {bootstrap_ms / 1000:.1f} s" in reason
        for x in (snd, custom, rcv):
            x.clear()


def test_poll_many_matches_single_polls(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        senders = [p.sender(r) for r in range(100, 130)]
        for r in range(100, 110):
            d.receiver(r, PREFILL_ADDR).init([r])
        got = p.poll_many(range(100, 131))
        assert got[130] == KVPoll.Failed  # no such participant
        for r in range(100, 110):
            assert got[r] == KVPoll.WaitingForInput
        for r in range(110, 130):
            assert got[r] == KVPoll.Bootstrapping
        for s in senders:
            s.clear()
        d.clear_many(range(100, 110))
        assert keys_of(store, store.keys.participant_pattern) == []


def test_two_senders_one_receiver_needs_both_acks(store: Store) -> None:
    p1 = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR)
    p2 = kvstate.KVManager(store, "prefill", "prefill-a.tp1", PREFILL_ADDR)
    d = kvstate.KVManager(store, "decode", "decode-b.tp0")
    with p1, p2, d:
        s1, s2 = p1.sender(5), p2.sender(5)
        rcv = d.receiver(5, PREFILL_ADDR)
        assert rcv.senders == []  # bound with its first operation, not at construction
        rcv.init([9, 10])
        assert rcv.senders == ["prefill-a.tp0", "prefill-a.tp1"]
        assert s1.poll() == s2.poll() == KVPoll.WaitingForInput
        for s in (s1, s2):
            with pytest.raises(kvstate.KVStateError, match="begin_transfer"):
                s.send([0, 1])  # no transport: nothing would move
        assert s1.begin_transfer() == KVPoll.Transferring
        s1.finish_transfer()
        assert rcv.poll() == KVPoll.WaitingForInput  # one of two acks
        s2.begin_transfer()
        s2.finish_transfer()
        assert rcv.poll() == KVPoll.Success
        for x in (s1, s2, rcv):
            x.clear()
        assert room_keys(store, 5) == []


def test_redis_cli_shows_status_by_name(store: Store, state_url: str, redis_cli) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = lifecycle(p, d, 31)
        key = store.keys.participant(31, "rx", d.engine)
        assert redis_cli(state_url, "HGET", key, "status").strip() == "Success"
        fields = redis_cli(state_url, "HGETALL", key).split()
        assert "created_ms" in fields and "peer:prefill-a.tp0" in fields
        snd.clear()
        rcv.clear()


def test_compact_indices(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(41, PREFILL_ADDR)
        rcv.init(np.arange(1000, 5096))
        raw = store.client.hget(store.keys.room_hash(41), schema.xfer_field(p.engine, d.engine))
        assert len(raw) < 100  # 4096 contiguous pages: one run, not 16 KiB
        snd = p.sender(41)
        snd.poll()
        assert np.array_equal(snd.transfer_infos()[d.engine].kv_indices, np.arange(1000, 5096))
        snd.clear()
        rcv.clear()


def test_parts_index_lives_as_long_as_its_participants(state_url: str) -> None:
    ttl = scaled(1.0)  # every wait below in TTLs, so a loaded host keeps the scenario
    s = kvstate.connect(state_url, namespace="t", room_ttl=ttl)
    p, d = managers(s, bootstrap_timeout=0, waiting_timeout=0)
    with p, d:
        snd = p.sender(61)
        rcv = d.receiver(61, PREFILL_ADDR)
        snd.poll()
        time.sleep(0.6 * ttl)
        rcv.init([1])  # refreshes the participants' TTLs, and the index's
        time.sleep(0.6 * ttl)
        snd.begin_transfer()
        time.sleep(0.2 * ttl)  # the index is 1.4 TTLs old: alive only through refreshes
        assert s.members(61) == ["rx:decode-b.tp0", "tx:prefill-a.tp0"]
        assert s.abort(61, "still reachable") == 2
        assert rcv.poll() == KVPoll.Failed
        snd.clear()
        rcv.clear()
        assert room_keys(s, 61) == []
    s.close()


def test_sender_never_begins_into_a_failed_or_cleared_receiver(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(71, PREFILL_ADDR)
        rcv.init([1, 2])
        snd = p.sender(71)
        assert snd.poll() == KVPoll.WaitingForInput
        rcv.fail("decode ran out of memory")  # only the receiver
        assert snd.begin_transfer() == KVPoll.Failed  # refused: nothing may be written
        assert "decode-b.tp0 failed before the transfer: decode ran out of memory" in (
            snd.failure_exception().reason
        )
        rcv.clear()
        rcv2 = d.receiver(72, PREFILL_ADDR)
        rcv2.init([3])
        snd2 = p.sender(72)
        snd2.poll()
        rcv2.clear()
        assert snd2.begin_transfer() == KVPoll.Failed
        assert "is gone" in snd2.failure_exception().reason
        assert room_keys(store, 71) == room_keys(store, 72) == []


def test_receiver_joining_a_failed_sender_fails_at_once(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(73)
        snd.poll()
        snd.abort("request cancelled")
        rcv = d.receiver(73, PREFILL_ADDR)
        assert rcv.init([1]) == KVPoll.Failed
        assert "request cancelled" in rcv.failure_exception().reason
        snd.clear()
        assert room_keys(store, 73) == []


def test_abort_before_either_side_joined_reaches_both(store: Store) -> None:
    assert store.abort(81, "router cancelled early") == 0  # nobody there yet
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(81, PREFILL_ADDR)
        assert rcv.init([1, 2]) == KVPoll.Failed
        snd = p.sender(81)
        assert snd.poll() == KVPoll.Failed
        assert snd.failure_exception().reason == "router cancelled early"
        assert rcv.failure_exception().reason == "router cancelled early"
        assert room_keys(store, 81) == []  # the clears took the mark too


def test_fan_out_reads_every_tracker_shard_and_the_unsharded_key(store: Store) -> None:
    """A prefill address's tracker is TRACKER_SHARDS sorted sets (issue 33): a dead
    prefill's fan-out reaches the receivers in every shard, and one that an engine
    before issue 33 tracked in the address's one unsharded sorted set."""
    p, d = managers(store)
    k, c = store.keys, store.client
    with p, d:
        rooms = list(range(100, 102 + TRACKER_SHARDS))  # every shard, two of them twice
        rcvs = [d.receiver(r, PREFILL_ADDR) for r in rooms]
        d.init_many(dict.fromkeys(rooms, np.arange(8)))
        assert {k.tracker(PREFILL_ADDR, r) for r in rooms} == set(k.trackers(PREFILL_ADDR)[:-1])
        assert all(c.zcard(t) for t in k.trackers(PREFILL_ADDR)[:-1])
        member = k.tracker_member(rooms[0], d.engine)  # as an older engine tracked it
        assert c.zrem(k.tracker(PREFILL_ADDR, rooms[0]), member) == 1
        c.zadd(k.addr(PREFILL_ADDR), {member: store.server_time_ms() + 60_000})
        c.pexpire(k.addr(PREFILL_ADDR), 60_000)
        assert store.fail_bound(PREFILL_ADDR, p.engine, "", "peer gone") == len(rooms)
        assert {r.poll() for r in rcvs} == {KVPoll.Failed}
        assert {r.reason for r in rcvs} == {"peer gone"}
        assert d.clear_many(rooms) == {}
        assert not any(c.exists(t) for t in k.trackers(PREFILL_ADDR)[:-1])
        c.delete(k.addr(PREFILL_ADDR))


@pytest.mark.cluster
def test_an_address_tracker_spreads_over_the_primaries(redis_cluster: RedisCluster) -> None:
    """On a Cluster the shards of one prefill address's tracker (the one per-engine key
    every lifecycle writes) are served by every primary, not one slot (issue 33)."""
    served = {redis_cluster.node_for_key(t).port for t in Keys("t").trackers(PREFILL_ADDR)}
    assert served == {n.port for n in redis_cluster.primaries()}


def test_bound_is_stored_only_while_short_of_peers(store: Store) -> None:
    """A receiver keeps `bound` only while it is bound to fewer senders than its `peers`
    (issue 33: missing, it is `peers`): bound to one of two senders it holds 1 and a
    bootstrap timeout names 1 of 2; bound to both, the field goes, it publishes, and
    `since_ms` is written only if that fell in another millisecond than its creation."""
    c, k = store.client, store.keys
    rx = k.participant(61, "rx", "d")
    fields = {schema.PEER_ADDR: PREFILL_ADDR, schema.PEERS: 0, schema.STATUS: "Bootstrapping"}
    store.execute([store.create(61, "rx", "d", fields)])
    assert c.hget(rx, schema.BOUND) is None  # 0 of 0
    store.execute([store.publish(61, "d", {"p0": "i0"}, required=2)])
    assert c.hmget(rx, schema.BOUND, schema.PEERS) == [b"1", b"2"]
    c.hset(rx, schema.CREATED_MS, store.server_time_ms() - 10_000)  # past the timeout
    c.hset(rx, schema.TIMEOUTS_MS, "1000 0")
    st = store.execute([store.poll(61, "rx", "d")])[0]
    assert st.status == KVPoll.Failed and "bound 1 of 2 senders" in st.reason
    store.execute(store.clear_calls(61, "rx", "d", senders=["p0"]))
    c.delete(k.aborted(61))  # the timeout's failure mark
    store.execute([store.create(62, "rx", "d", fields)])
    store.execute([store.publish(62, "d", {"p0": "i0"}, required=2)])
    st = store.execute([store.publish(62, "d", {"p1": "i1"}, b"info", required=2)])[0]
    rx = k.participant(62, "rx", "d")
    assert st.status == KVPoll.WaitingForInput
    assert c.hget(rx, schema.BOUND) is None and c.hget(rx, schema.PEERS) == b"2"
    created, since = c.hmget(rx, schema.CREATED_MS, schema.SINCE_MS)
    assert since is None or since != created
    st = store.execute([store.poll(62, "rx", "d")])[0]
    assert st.status == KVPoll.WaitingForInput
    store.execute(store.clear_calls(62, "rx", "d", senders=["p0", "p1"]))
