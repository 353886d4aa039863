"""The stored vocabulary (kvstate.schema) and the room-key parser (Keys.parse_room_key).

No Redis: these read and write strings only. Hostile inputs come from keys an operator
tool may meet in a shared Redis (another namespace, foreign tags, odd digits)."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from kvstate import schema
from kvstate.keys import MAX_ROOM, Keys, RoomKey
from kvstate.poll import KVPoll
from kvstate.schema import Member
from tests.helpers import scaled

NAME_CHARS = "abcXYZ019_.:@/[]-"
names = st.text(alphabet=NAME_CHARS, min_size=1, max_size=40)
sides = st.sampled_from(schema.SIDES)
rooms = st.integers(min_value=0, max_value=MAX_ROOM - 1)


# -- member codec --------------------------------------------------------------------
@given(sides, names)
def test_member_round_trips(side: schema.Side, engine: str) -> None:
    text = schema.member(side, engine)
    assert text == f"{side}:{engine}"
    assert schema.parse_member(text) == Member(side, engine)
    assert str(Member(side, engine)) == text


@given(st.text(max_size=30))
def test_parse_member_never_raises_and_keeps_only_sides(text: str) -> None:
    m = schema.parse_member(text)
    if m is not None:
        assert m.side in schema.SIDES
        assert text == m.side or text.startswith(m.side + ":")


def test_parse_member_hostile() -> None:
    for text in ("", ":", "xx:e", "TX:e", "tx", "rx", " tx:e", "txe"):
        m = schema.parse_member(text)
        # a member without an engine still names a key (the scripts abort it as such)
        assert m is None or (m.engine == "" and text in ("tx", "rx"))
    assert schema.parse_member("tx:host:5000") == Member("tx", "host:5000")
    assert schema.parse_member("rx:") == Member("rx", "")


def test_side_of() -> None:
    assert [schema.side_of(s) for s in ("tx", "rx", "xfer", "", "TX")] == [
        "tx",
        "rx",
        None,
        None,
        None,
    ]


# -- peer fields ---------------------------------------------------------------------
@given(names)
def test_peer_field_round_trips(engine: str) -> None:
    assert schema.peer_of(schema.peer_field(engine)) == engine


def test_peer_of_refuses_other_fields() -> None:
    for name in (schema.STATUS, schema.PEERS, schema.PEER_ADDR, "peer:", "peer", "Peer:x"):
        assert schema.peer_of(name) is None


@given(st.dictionaries(names, names, max_size=5), st.dictionaries(names, names, max_size=5))
def test_bindings_reads_only_peer_fields(peers: dict[str, str], other: dict[str, str]) -> None:
    fields = {f"x{k}": v for k, v in other.items()}  # no other field starts with peer:
    fields.update({schema.peer_field(e): inc for e, inc in peers.items()})
    assert schema.bindings(fields) == peers


# -- field tables --------------------------------------------------------------------
def test_status_timeouts_name_statuses_and_places() -> None:
    for status, (name, _) in schema.STATUS_TIMEOUTS.items():
        assert status in KVPoll.__members__
        assert name == status[: len(name)].lower()
    assert sorted(at for _, at in schema.STATUS_TIMEOUTS.values()) == [0, 1]


def test_timeouts_value_parses_back() -> None:
    assert schema.timeouts_value(300_000, 0) == "300000 0"
    assert schema.parse_timeouts("300000 0") == (300_000, 0)
    for bad in (None, "", "1", "1 2 3", "-1 2", "1,2", "x 1", "٣ 1"):
        assert schema.parse_timeouts(bad) is None, bad


def test_field_names_are_distinct_per_hash() -> None:
    participant = [
        schema.STATUS,
        schema.SINCE_MS,
        schema.CREATED_MS,
        schema.REASON,
        schema.PEERS,
        schema.PEER_ADDR,
        schema.TIMEOUTS_MS,
        schema.INFOS_V,
        schema.BOUND,
    ]
    engine = [
        schema.ROLE,
        schema.ADDR,
        schema.INCARNATION,
        schema.HOST,
        schema.PID,
        schema.ENDPOINT,
        schema.LAYOUT,
        schema.GPUS,
        schema.RANKS,
    ]
    for table in (participant, engine, list(schema.LEDGER_FIELDS)):
        assert len(set(table)) == len(table)
    # no fixed field may be read as a peer binding
    assert not schema.bindings(dict.fromkeys(participant, "1"))


def test_le_field() -> None:
    assert schema.le_field(0.005) == "le:0.005"
    assert schema.le_field("+Inf") == "le:+Inf"


# -- room keys -----------------------------------------------------------------------
@given(rooms, sides, names)
def test_participant_key_parses_back(room: int, side: schema.Side, engine: str) -> None:
    k = Keys("ns")
    key = k.participant(room, side, engine)
    parsed = k.parse_room_key(key)
    assert parsed == RoomKey(key, room, side, engine)
    assert parsed.side == side and parsed.engine == engine
    assert parsed.participant == (side, engine)


@given(rooms, names)
def test_other_room_keys_parse_back(room: int, engine: str) -> None:
    k = Keys("ns")
    for key, kind, rest in (
        (k.room_hash(room), "room", ""),
        (k.aborted(room), "aborted", ""),
        (k.trace(room), "trace", ""),
    ):
        parsed = k.parse_room_key(key)
        assert parsed == RoomKey(key, room, kind, rest)
        assert parsed.side is None and parsed.participant is None
        assert parsed.engine == rest


@given(names, names)
def test_room_hash_fields_parse_back(sender: str, receiver: str) -> None:
    """A field of the room hash splits back one way only, whatever the engine names
    hold (':' included): SEP is no character of a name."""
    assert schema.SEP not in sender + receiver
    assert schema.parse_room_field(schema.member("tx", sender)) == ("tx", sender, "")
    assert schema.parse_room_field(schema.member("rx", receiver)) == ("rx", receiver, "")
    xfer = schema.parse_room_field(schema.xfer_field(sender, receiver))
    assert xfer == ("xfer", sender, receiver)
    assert schema.parse_room_field(schema.ack_field(receiver)) == ("ack", receiver, "")
    assert schema.ack_list(schema.SEP.join([sender, receiver])) == [sender, receiver]
    assert schema.parse_room_field("xfer:" + sender) is None  # no SEP: not kvstate's
    assert schema.parse_room_field("weird") is None


def test_parse_room_key_hostile() -> None:
    k = Keys("ns")
    for key in (
        "",
        "kvstate:ns:",
        "kvstate:ns:{",
        "kvstate:ns:{}:tx:e",
        "kvstate:ns:{1}",  # no "}:" after the tag
        "kvstate:ns:{1}tx:e",
        "kvstate:ns:{-1}:tx:e",
        "kvstate:ns:{+1}:tx:e",
        "kvstate:ns:{4_2}:tx:e",  # int() would read 42
        "kvstate:ns:{٤٢}:tx:e",  # Arabic-Indic digits: int() would read 42
        "kvstate:ns:{ 42}:tx:e",
        f"kvstate:ns:{{{MAX_ROOM}}}:tx:e",  # out of range
        "kvstate:ns:{12345678901234567890}:tx:e",  # 20 digits
        "kvstate:nsx:{1}:tx:e",  # another namespace sharing the prefix
        "kvstate:other:{1}:tx:e",
        "kvstate:ns:engine:e",
        "kvstate:ns:addr:{1}:tx:e",
        "other:ns:{1}:tx:e",
    ):
        assert k.parse_room_key(key) is None, key


def test_parse_room_key_odd_but_parsable() -> None:
    k = Keys("ns")
    p = k.parse_room_key("kvstate:ns:{7}:tx:host:5000")  # engine names may hold ':'
    assert p is not None and p.participant == ("tx", "host:5000")
    p = k.parse_room_key("kvstate:ns:{7}:weird")  # unknown kind: kept, not a participant
    assert p is not None and (p.kind, p.rest, p.side, p.engine) == ("weird", "", None, "")
    p = k.parse_room_key("kvstate:ns:{7}:tx:")  # an empty engine is still a tx key
    assert p is not None and p.participant == ("tx", "")
    p = k.parse_room_key(f"kvstate:ns:{{{MAX_ROOM - 1}}}:room")
    assert p is not None and p.room == MAX_ROOM - 1


@given(st.text(max_size=60))
def test_parse_room_key_never_raises(tail: str) -> None:
    k = Keys("ns")
    for key in (tail, k.prefix + tail, k.prefix + "{" + tail, k.prefix + "{1}:" + tail):
        p = k.parse_room_key(key)
        if p is not None:
            assert p.key == key
            assert key.startswith(k.room_prefix(p.room))
            assert 0 <= p.room < MAX_ROOM


# -- layering ------------------------------------------------------------------------
def test_the_core_imports_no_ops_cli_demo_or_testing() -> None:
    """The engines' side (roles, store, registry, stats, schema) stands alone: the
    operator tools build on it, never the other way round."""
    code = (
        "import sys, kvstate, kvstate.roles, kvstate.store, kvstate.registry, "
        "kvstate.stats, kvstate.schema, kvstate.keys, kvstate.defaults\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    ).stdout.split()
    outside = ("kvstate.ops", "kvstate.cli", "kvstate.demo", "kvstate.testing")
    assert [m for m in out if m.startswith(outside)] == []
