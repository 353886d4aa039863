"""The stored vocabulary: hash field names and member formats of kvstate's keys.

Key *names* are built (and parsed back) in ``kvstate.keys``; what goes *inside* the
keys is spelled here and mirrored by the constants at the top of
``kvstate/scripts/_lib.lua`` (a test holds the two together). Change a field in these
two files, nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, NamedTuple, TypeVar

from kvstate.defaults import BOOTSTRAP_TIMEOUT, WAITING_TIMEOUT
from kvstate.errors import InvalidValueError

Side = Literal["tx", "rx"]  # tx: a sender (prefill), rx: a receiver (decode)
SIDES: Final[tuple[Side, ...]] = ("tx", "rx")

# -- participant hash: kvstate:<ns>:{<room>}:<side>:<engine> ---------------------------
STATUS: Final = "status"  # a KVPoll name
# server ms of the last status change; not stored while it equals CREATED_MS (a
# participant still in the status it was created in): readers use since() for it
SINCE_MS: Final = "since_ms"
CREATED_MS: Final = "created_ms"  # server ms of the create (create.lua)
REASON: Final = "reason"  # text, set with Failed
# (no addr: the participant's own engine's bootstrap address is its registration's)
PEERS: Final = "peers"  # senders a receiver waits for / receivers a sender serves
PEER_ADDR: Final = "peer_addr"  # receiver: the prefill side's bootstrap address
# "<bootstrap ms> <waiting ms>" (timeouts_value()): the limits of Bootstrapping and
# WaitingForInput, 0 for none; one field, not two (each costs its name in the listpack).
# Not stored when it is DEFAULT_TIMEOUTS_MS (kvstate.defaults'): most participants
TIMEOUTS_MS: Final = "timeouts_ms"
INFOS_V: Final = "infos_v"  # sender: publishes addressed to it so far
BOUND: Final = "bound"  # receiver: senders bound so far
PEER_PREFIX: Final = "peer:"  # receiver: peer:<engine> -> that engine's incarnation

# The bounds of stored numbers, mirrored in _lib.lua (tests/test_schema_lua.py): the
# scripts refuse a value outside them as corrupt, never read it as a count (design rule
# 7, issue 30); the builders of what kvstate writes refuse to write one.
MAX_PEERS: Final = 65536  # peers, bound, an index member's ranks, acks of a receiver
MAX_COUNT: Final = 2**40  # infos_v
MAX_TIMEOUT_MS: Final = 2**42  # each of timeouts_ms (139 years; 0 is none)
MIN_TIME_MS: Final = 10**12  # created_ms, since_ms: not before 2001-09-09...
MAX_SKEW_MS: Final = 60_000  # ...nor more than a minute past the server clock
MAX_ACKS_BYTES: Final = 65536  # an ack:<receiver> list

_V = TypeVar("_V")

# The timeout that applies in a status: (its name for people, its place in TIMEOUTS_MS).
STATUS_TIMEOUTS: Final[Mapping[str, tuple[str, int]]] = {
    "Bootstrapping": ("bootstrap", 0),
    "WaitingForInput": ("waiting", 1),
}


def since(fields: Mapping[str, _V]) -> _V | None:
    """When a participant entered its status: SINCE_MS, else (none written since its
    create) CREATED_MS."""
    value = fields.get(SINCE_MS)
    return fields.get(CREATED_MS) if value is None else value


def timeouts_value(bootstrap_ms: int, waiting_ms: int) -> str:
    """The TIMEOUTS_MS field's value; InvalidValueError for a timeout the scripts would
    read as corrupt (over MAX_TIMEOUT_MS: 0 means none)."""
    for ms in (bootstrap_ms, waiting_ms):
        if not 0 <= int(ms) <= MAX_TIMEOUT_MS:
            raise InvalidValueError(
                f"a timeout must be from 0 (none) to {MAX_TIMEOUT_MS // 1000} s, got {ms} ms"
            )
    return f"{int(bootstrap_ms)} {int(waiting_ms)}"


def check_count(value: object, what: str, low: int = 0, high: int = MAX_PEERS) -> int:
    """A count kvstate writes (peers, senders required): an int from ``low`` to
    ``high``, as the scripts read it back; InvalidValueError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidValueError(f"{what} must be an int from {low} to {high}, got {value!r}")
    return value


# what a participant without TIMEOUTS_MS has (mirrored in _lib.lua: poll.lua applies it)
DEFAULT_TIMEOUTS_MS: Final = timeouts_value(
    int(BOOTSTRAP_TIMEOUT * 1000), int(WAITING_TIMEOUT * 1000)
)


def parse_count(value: object, low: int = 0, high: int = MAX_COUNT) -> int | None:
    """A stored count or time as the scripts read it (_lib.lua's count_of): ASCII digits
    as kvstate writes them (no sign, no leading zero, at most 16), from ``low`` to
    ``high``; None for anything else (the scripts refuse it as corrupt)."""
    if not isinstance(value, str) or not 0 < len(value) <= 16:
        return None
    if not (value.isascii() and value.isdigit()) or (len(value) > 1 and value[0] == "0"):
        return None
    n = int(value)
    return n if low <= n <= high else None


def corrupt_fields(fields: Mapping[str, str], now_ms: int) -> list[str]:
    """The numeric fields of a participant hash the scripts would refuse as corrupt
    (peers, bound, infos_v, timeouts_ms, the time its status is read from)."""
    bad = []
    for name, high in ((PEERS, MAX_PEERS), (BOUND, MAX_PEERS), (INFOS_V, MAX_COUNT)):
        if name in fields and parse_count(fields[name], 0, high) is None:
            bad.append(name)
    if timeouts_of(fields) is None:
        bad.append(TIMEOUTS_MS)
    at = SINCE_MS if SINCE_MS in fields else CREATED_MS
    if parse_count(fields.get(at), MIN_TIME_MS, now_ms + MAX_SKEW_MS) is None:
        bad.append(at)
    return bad


def timeouts_of(fields: Mapping[str, str]) -> tuple[int, int] | None:
    """(bootstrap ms, waiting ms) of a participant's fields: its TIMEOUTS_MS, else
    (none stored) DEFAULT_TIMEOUTS_MS; None when the stored one does not parse."""
    return parse_timeouts(fields.get(TIMEOUTS_MS, DEFAULT_TIMEOUTS_MS))


def parse_timeouts(value: str | None) -> tuple[int, int] | None:
    """(bootstrap ms, waiting ms) of a TIMEOUTS_MS value; None when it does not parse
    (as poll.lua reads it: two counts up to MAX_TIMEOUT_MS)."""
    parts = (value or "").split(" ")
    if len(parts) != 2:
        return None
    limits = [parse_count(p, 0, MAX_TIMEOUT_MS) for p in parts]
    if limits[0] is None or limits[1] is None:
        return None
    return limits[0], limits[1]


# -- engine registration hash: kvstate:<ns>:engine:<engine> ----------------------------
ROLE: Final = "role"  # prefill / decode
INCARNATION: Final = "incarnation"  # changes with every new KVManager of the name
HOST: Final = "host"
ADDR: Final = "addr"  # the engine's bootstrap address
PID: Final = "pid"
ENDPOINT: Final = "endpoint"  # the transport's endpoint blob
LAYOUT: Final = "layout"  # msgpack {"layout": {...}}
GPUS: Final = "gpus"  # msgpack {"gpus": [...]}
RANKS: Final = "ranks"  # prefill ranks serving the address
# the FUNCTION library of the engine's kvstate (kvstate.store.functions.NAME): which
# libraries on a server a live engine may still use (`kvstate functions prune`)
LIBRARY: Final = "library"

# -- the room hash: kvstate:<ns>:{<room>}:room (one per room, beside its participants) ----
# field "<side>:<engine>" (member())       -> '': the room's participants (the field is
#                                          the entry; its created_ms is the participant's)
# field "xfer:<sender>,<receiver>"         -> packed TransferInfo (xfer_field())
# field "ack:<receiver>"                   -> the senders that finished for it, SEP-joined
# field "hold"                             -> a decode engine holds the room queued until
#                                          this server time (ms; hold.lua): its senders'
#                                          bootstrap timeout waits for it (poll.lua)
# Engine names never hold SEP (keys.check_name), so a field splits back one way only.
XFER_PREFIX: Final = "xfer:"
ACK_PREFIX: Final = "ack:"
HOLD: Final = "hold"
SEP: Final = ","
ROOM_DATA: Final = (XFER_PREFIX, ACK_PREFIX, HOLD)  # the room hash's fields that are no member

# -- other keys' members ---------------------------------------------------------------
# tracker     addr:<addr>#<shard>   zset, members "<room> <receiver engine>"
#                                   (keys.Keys.tracker, tracker_member)
# index       engines_at:<addr>     members "<engine> <incarnation> <ranks> <role>"
#                                   (registry.index_member), scored by lease deadline (ms)

# -- room trace list: kvstate:<ns>:{<room>}:trace (kvstate.trace) ----------------------
# Each entry, a JSON object: TRACE_MS (server clock), TRACE_SIDE (tx / rx, '' for the
# room), TRACE_ENGINE, TRACE_EVENT (one of the EV_ names below or a status name), then
# STATUS, REASON, TRACE_PEER, INCARNATION, TRACE_WAS where they apply.
TRACE_MS: Final = "ms"
TRACE_SIDE: Final = "side"
TRACE_ENGINE: Final = "engine"
TRACE_EVENT: Final = "event"
TRACE_PEER: Final = "peer"  # bound / published: the sender engine
TRACE_WAS: Final = "was"  # abort: the status the participant had before
EV_CREATED: Final = "created"
EV_BOUND: Final = "bound"  # a receiver bound a sender (at INCARNATION)
EV_PUBLISHED: Final = "published"  # a receiver's transfer info went to a sender
EV_ABORT: Final = "abort"
EV_CLEARED: Final = "cleared"
# Written by Python, not a script (no Lua mirror): the serving request's W3C trace
# context, appended (RPUSHX) in a participant's create batch when its engine passes one
# (kvstate.trace.traceparent); TRACE_MS 0, it is no step of the room.
EV_CONTEXT: Final = "context"
TRACE_PARENT: Final = "traceparent"

# -- transfer counters hash: kvstate:<ns>:stats:<engine> -------------------------------
STATS_BYTES: Final = "bytes"
STATS_COUNT: Final = "count"
STATS_SECONDS: Final = "seconds"
STATS_LE_PREFIX: Final = "le:"  # le:<bound> -> transfers in that latency bucket

# -- ledger stream: kvstate:<ns>:ledger, one entry per reaped or repaired thing -------
LEDGER_FIELDS: Final = ("event", "room", "side", "engine", "status", "age_ms", "key", "detail")


class Member(NamedTuple):
    """A participant field of the room hash: which participant of the room."""

    side: Side
    engine: str

    def __str__(self) -> str:
        return member(self.side, self.engine)


def member(side: Side, engine: str) -> str:
    """The room-hash field of a participant (``tx:<engine>`` / ``rx:<engine>``)."""
    return f"{side}:{engine}"


def side_of(text: str) -> Side | None:
    """``text`` as a Side, or None when it is not one (typed narrowing for callers)."""
    if text == "tx":
        return "tx"
    if text == "rx":
        return "rx"
    return None


def parse_member(text: str) -> Member | None:
    """Read back a participant field of the room hash; None unless it starts with
    ``tx``/``rx``. What follows the first ``:`` is the engine, '' if nothing does (a
    corrupt member still names the key the scripts would use for it)."""
    head, _, engine = text.partition(":")
    side = side_of(head)
    return None if side is None else Member(side, engine)


def xfer_field(sender: str, receiver: str) -> str:
    """The room-hash field of the transfer info ``receiver`` published to ``sender``."""
    return f"{XFER_PREFIX}{sender}{SEP}{receiver}"


def ack_field(receiver: str) -> str:
    """The room-hash field listing the senders that finished for ``receiver``."""
    return f"{ACK_PREFIX}{receiver}"


class RoomField(NamedTuple):
    """A room-hash field read back: ``kind`` is tx / rx (a participant: ``engine``), xfer
    (``engine`` the sender, ``peer`` the receiver), ack (``engine`` the receiver) or
    hold (the decode's queue holds the room)."""

    kind: str
    engine: str
    peer: str = ""


def parse_room_field(text: str) -> RoomField | None:
    """Read back a room-hash field; None when it is none of kvstate's."""
    if text.startswith(XFER_PREFIX):
        sender, sep, receiver = text[len(XFER_PREFIX) :].partition(SEP)
        return RoomField("xfer", sender, receiver) if sep else None
    if text.startswith(ACK_PREFIX):
        return RoomField("ack", text[len(ACK_PREFIX) :])
    if text == HOLD:
        return RoomField("hold", "")
    part = parse_member(text)
    return None if part is None else RoomField(part.side, part.engine)


def ack_list(value: str) -> list[str]:
    """The senders an ``ack:<receiver>`` field lists."""
    return [s for s in value.split(SEP) if s]


def peer_field(engine: str) -> str:
    """The receiver field that binds it to a sender engine (value: the incarnation)."""
    return f"{PEER_PREFIX}{engine}"


def peer_of(field: str) -> str | None:
    """The sender engine a ``peer:<engine>`` field names, else None."""
    if field.startswith(PEER_PREFIX) and len(field) > len(PEER_PREFIX):
        return field[len(PEER_PREFIX) :]
    return None


def bindings(fields: Mapping[str, _V]) -> dict[str, _V]:
    """Sender engine -> incarnation, from a receiver hash's ``peer:`` fields."""
    out: dict[str, _V] = {}
    for name, value in fields.items():
        engine = peer_of(name)
        if engine is not None:
            out[engine] = value
    return out


def le_field(bound: object) -> str:
    """The transfer-counter field of one latency bucket (``le:0.005``, ``le:+Inf``)."""
    return f"{STATS_LE_PREFIX}{bound}"


def clear_owners(name: str) -> list[tuple[Side, str]]:
    """The participants whose clear takes a room-hash field of transfer infos (its
    sender and its receiver) or acks (its receiver); [] for a participant field or
    the hold (every clear takes it). The audit's view of ``Calls.clear_calls``."""
    f = parse_room_field(name)
    if f is None or f.kind in (*SIDES, "hold"):  # a hold: every clear takes it
        return []
    if f.kind == "xfer":
        return [("tx", f.engine), ("rx", f.peer)]
    return [("rx", f.engine)]


def cleared_by(side: str, engine: str, fields: Mapping[str, object]) -> list[str]:
    """The room-hash fields a participant's clear takes besides its member: a sender's
    transfer infos, a receiver's acks and the infos it published."""
    out = []
    for name in sorted(fields):
        f = parse_room_field(name)
        if f is None or f.kind in SIDES:
            continue
        mine = (
            (f.kind == "xfer" and f.engine == engine)
            if side == "tx"
            else (
                (f.kind == "xfer" and f.peer == engine) or (f.kind == "ack" and f.engine == engine)
            )
        )
        if mine:
            out.append(name)
    return out
