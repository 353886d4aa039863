"""Key names (kvstate.keys): the builder, the hash tag that keeps a room in one slot,
and the validation of what people and engines pass in. No Redis."""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from kvstate.errors import InvalidNameError, InvalidRoomError
from kvstate.keys import (
    MAX_ROOM,
    ROOT,
    TRACKER_SHARDS,
    Keys,
    check_name,
    check_namespace,
    check_room,
    namespace_of,
    parse_room_text,
)

rooms = st.integers(min_value=0, max_value=MAX_ROOM - 1)


def test_builder_spells_every_key() -> None:
    k = Keys("ns")
    assert k.prefix == "kvstate:ns:"
    assert k.room_prefix(42) == "kvstate:ns:{42}:"
    assert k.participant(42, "tx", "prefill-0") == "kvstate:ns:{42}:tx:prefill-0"
    assert k.participant(42, "rx", "decode-0") == "kvstate:ns:{42}:rx:decode-0"
    assert k.room_hash(42) == "kvstate:ns:{42}:room"
    assert k.aborted(42) == "kvstate:ns:{42}:aborted"
    assert k.part_member("tx", "p") == "tx:p"
    assert k.addr("10.0.0.1:8998") == "kvstate:ns:addr:10.0.0.1:8998"
    assert k.tracker("10.0.0.1:8998", 42) == "kvstate:ns:addr:10.0.0.1:8998#42"
    assert k.tracker("10.0.0.1:8998", 64 + 3) == "kvstate:ns:addr:10.0.0.1:8998#3"
    assert k.engine("p") == "kvstate:ns:engine:p"
    assert k.engines_at("h:1") == "kvstate:ns:engines_at:h:1"
    assert k.ledger == "kvstate:ns:ledger"
    assert k.transfer_stats("p") == "kvstate:ns:stats:p"
    assert Keys().namespace == "default"


@given(rooms, st.text(alphabet="abc:.-_019[]@/", min_size=1, max_size=30))
def test_tracker_members_name_their_receiver(room: int, engine: str) -> None:
    k = Keys("ns")
    member = k.tracker_member(room, engine)
    assert member == f"{room} {engine}"
    assert k.tracked_key(member) == k.participant(room, "rx", engine)
    # a member written before issue 22 (the receiver's key name) still names it
    assert k.tracked_key(k.participant(room, "rx", engine)) == k.participant(room, "rx", engine)


def test_an_address_tracker_is_its_shards_and_its_unsharded_key() -> None:
    """A room's receivers go to shard room % TRACKER_SHARDS; fan-out reads every shard
    and the one sorted set engines before issue 33 wrote; every name matches the
    SCAN pattern the audit and the views read trackers by."""
    k = Keys("ns")
    shards = k.trackers("h:1")
    assert len(shards) == TRACKER_SHARDS + 1 and shards[-1] == k.addr("h:1")
    assert {k.tracker("h:1", room) for room in range(3 * TRACKER_SHARDS)} == set(shards[:-1])
    assert all(fnmatch.fnmatchcase(t, k.addr_pattern) for t in shards)
    with pytest.raises(InvalidRoomError):
        k.tracker("h:1", -1)


def test_tracker_members_that_name_no_receiver() -> None:
    k = Keys("ns")
    for member in ("", "42", "42 ", "x d", "-1 d", f"{MAX_ROOM} d", "kvstate:ns:{1}:tx:p"):
        assert k.tracked_key(member) is None, member


def test_patterns() -> None:
    k = Keys("ns")
    assert k.all_pattern == "kvstate:ns:*"
    assert k.participant_pattern == "kvstate:ns:{*}:[tr]x:*"
    assert k.engine_pattern == "kvstate:ns:engine:*"
    assert k.transfer_stats_pattern == "kvstate:ns:stats:*"
    assert k.addr_pattern == "kvstate:ns:addr:*"


@given(rooms, st.text(alphabet="abc:.-_019", min_size=1, max_size=30))
def test_a_room_lives_in_one_slot(room: int, engine: str) -> None:
    """One script moves both sides of a room: on a Cluster that needs one slot."""
    k = Keys("ns")
    keys = [
        k.participant(room, "tx", engine),
        k.participant(room, "rx", engine),
        k.room_hash(room),
        k.aborted(room),
        k.trace(room),
    ]
    assert len({key_slot(key.encode()) for key in keys}) == 1


@pytest.mark.parametrize("room", [0, 1, 42, MAX_ROOM - 1])
def test_check_room_accepts(room: int) -> None:
    assert check_room(room) == room


@pytest.mark.parametrize("room", [-1, MAX_ROOM, True, False, 1.0, "1", None, b"1"])
def test_check_room_refuses(room: object) -> None:
    with pytest.raises(InvalidRoomError, match=r"2\*\*63"):
        check_room(room)


@pytest.mark.parametrize(
    "name", ["p", "prefill-0", "host:5000", "[::1]:8998", "a@b/c.d_e", "x" * 200]
)
def test_check_name_accepts(name: str) -> None:
    assert check_name(name, "engine") == name


@pytest.mark.parametrize(
    "name",
    ["", "x" * 201, "a b", "a\tb", "a\nb", "{tag}", "a*", "a?", "é", None, 1, b"p"],
)
def test_check_name_refuses(name: object) -> None:
    with pytest.raises(InvalidNameError, match="engine must be"):
        check_name(name, "engine")


@pytest.mark.parametrize("ns", ["default", "a", "A.b-c_9", "x" * 64])
def test_check_namespace_accepts(ns: str) -> None:
    assert check_namespace(ns) == ns
    assert Keys(ns).namespace == ns


@pytest.mark.parametrize("ns", ["", "x" * 65, "a:b", "a b", "{x}", "a*", None, 3])
def test_check_namespace_refuses(ns: object) -> None:
    with pytest.raises(InvalidNameError, match="namespace"):
        check_namespace(ns)
    with pytest.raises(InvalidNameError):
        Keys(ns)  # type: ignore[arg-type]


@given(rooms)
def test_parse_room_text_round_trips(room: int) -> None:
    assert parse_room_text(str(room)) == room


@pytest.mark.parametrize(
    "text", ["", " 42", "42 ", "4_2", "٤٢", "+1", "-1", "0x2a", "1e3", str(MAX_ROOM), "9" * 20]
)
def test_parse_room_text_refuses(text: str) -> None:
    with pytest.raises(InvalidRoomError, match="ASCII digits"):
        parse_room_text(text)


def test_namespace_of() -> None:
    assert namespace_of("kvstate:ns:{1}:tx:p") == "ns"
    assert namespace_of("kvstate:ns:engine:p") == "ns"
    assert namespace_of(ROOT + "bad ns:x") is None
    assert namespace_of("other:ns:x") is None
    assert namespace_of("kvstate:") is None
