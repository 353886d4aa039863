"""The one place that spells Redis key names (docs/design.md, Data model).

Every per-room key carries the hash tag ``{<room>}`` so that all keys of a room
share one Cluster slot and one Lua script can move both sides of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvstate import schema
from kvstate.errors import InvalidNameError, InvalidRoomError
from kvstate.schema import SIDES, Side

__all__ = [
    "MAX_ROOM",
    "ROOT",
    "TRACKER_SHARDS",
    "SIDES",
    "Keys",
    "RoomKey",
    "Side",
    "check_name",
    "check_namespace",
    "check_room",
    "namespace_of",
    "parse_room_text",
]

MAX_ROOM = 2**63
# A prefill address's tracker is this many sorted sets, a room's receivers in shard
# room % TRACKER_SHARDS (issue 33): each shard stays a listpack (<= 128 members, Redis'
# zset-max-listpack-entries) up to ~8,000 rooms in flight per address, ~45 B a member
# where one skiplist zset took ~135, and on a Cluster the shards spread an address's
# tracker writes over the primaries instead of one slot. Every engine sharing a
# namespace uses the same count (it is part of the key names).
TRACKER_SHARDS = 64

ROOT = "kvstate:"  # every kvstate key starts with it, then "<namespace>:"
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ROOM = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() also takes "4_2" and "٤٢"
# Engine ids and bootstrap addresses end up inside key names and Lua-built
# messages: allow what host:port, IPv6 brackets and rank suffixes need, no
# whitespace, braces (hash tags) or glob characters (SCAN patterns).
_NAME = re.compile(r"[A-Za-z0-9_.:@/\[\]-]{1,200}")


def check_room(room: object) -> int:
    """Return ``room`` if it is a valid bootstrap room, else raise InvalidRoomError."""
    if isinstance(room, bool) or not isinstance(room, int):
        raise InvalidRoomError(
            f"room must be an int in [0, 2**63), got {type(room).__name__} {room!r}"
        )
    if not 0 <= room < MAX_ROOM:
        raise InvalidRoomError(f"room must be in [0, 2**63), got {room}")
    return room


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidNameError(
            f"{what} must be 1-200 characters of letters, digits and _.:@/[]-, got {value!r}"
        )
    return value


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise InvalidNameError(
            f"namespace must be 1-64 characters of letters, digits and _.-, got {namespace!r}"
        )
    return namespace


def parse_room_text(text: str) -> int:
    """A room id typed by a person: ASCII digits only (``int()`` would read ``4_2``,
    `` 42`` and Arabic-Indic digits as room 42)."""
    if not _ROOM.fullmatch(text) or int(text) >= MAX_ROOM:
        raise InvalidRoomError(
            f"room must be an integer in [0, 2**63) written in ASCII digits, got {text!r}"
        )
    return int(text)


def namespace_of(key: str) -> str | None:
    """The namespace a kvstate key belongs to, else None (to list the namespaces)."""
    if not key.startswith(ROOT):
        return None
    ns = key[len(ROOT) :].partition(":")[0]
    return ns if _NAMESPACE.fullmatch(ns) else None


class Keys:
    """Key builder for one namespace."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = check_namespace(namespace)
        self.prefix = f"{ROOT}{self.namespace}:"

    # -- per room (one slot) -------------------------------------------------
    def room_prefix(self, room: int) -> str:
        return f"{self.prefix}{{{check_room(room)}}}:"

    def participant(self, room: int, side: Side, engine: str) -> str:
        return f"{self.room_prefix(room)}{side}:{engine}"

    def room_hash(self, room: int) -> str:
        """The room's one shared hash (fields spelled in ``kvstate.schema``): its
        participants (``tx:<engine>`` / ``rx:<engine>``, value '': the field is the entry),
        so that abort and ``kvstate show`` find them without SCAN, the transfer infos each receiver
        published to each sender and the acks of each receiver. A hash, not a key per
        thing: Redis 7.0 keeps a small hash as one listpack, and each key costs its name,
        its value object and two dict entries. It vanishes with its last field."""
        return f"{self.room_prefix(room)}room"

    def aborted(self, room: int) -> str:
        """The room's failure mark: the reason of its first failure (an abort, a timeout,
        a dead peer...), so that no participant of it reaches Success and one created
        later starts Failed. clear() leaves it; it expires on its own TTL."""
        return f"{self.room_prefix(room)}aborted"

    def trace(self, room: int) -> str:
        """The room's trace (a list of every transition, kvstate.trace): kept
        after the room's clear, with a TTL of its own (``Options.trace_ttl``)."""
        return f"{self.room_prefix(room)}trace"

    def is_mark(self, key: str) -> bool:
        """Whether ``key`` is a room's failure mark: intended state with a TTL that
        outlives clear(), not a participant's key left behind."""
        parsed = self.parse_room_key(key)
        return parsed is not None and parsed.kind == "aborted" and not parsed.rest

    def is_trace(self, key: str) -> bool:
        """Whether ``key`` is a room's trace: kept after clear() with its own TTL
        (``Options.trace_ttl``), not a participant's key left behind."""
        parsed = self.parse_room_key(key)
        return parsed is not None and parsed.kind == "trace" and not parsed.rest

    @staticmethod
    def part_member(side: Side, engine: str) -> str:
        return schema.member(side, engine)

    # -- shared ----------------------------------------------------------------
    def addr(self, bootstrap_addr: str) -> str:
        """A peer address's tracker as engines before issue 33 wrote it, one sorted set
        (``trackers`` still lists it, so fan-out reads what they left); the prefix of
        its shards (``tracker``)."""
        return f"{self.prefix}addr:{bootstrap_addr}"

    def tracker(self, bootstrap_addr: str, room: int) -> str:
        """The shard of ``bootstrap_addr``'s tracker that holds ``room``'s receivers
        (``tracker_member``), scored by deadline (ms): ``addr:<addr>#<room % 64>``
        (no address holds ``#``, ``check_name``)."""
        return f"{self.addr(bootstrap_addr)}#{check_room(room) % TRACKER_SHARDS}"

    def trackers(self, bootstrap_addr: str) -> list[str]:
        """Every shard of ``bootstrap_addr``'s tracker, then its unsharded key (written
        by engines before issue 33): what fan-out reads to find the bound receivers."""
        return [f"{self.addr(bootstrap_addr)}#{n}" for n in range(TRACKER_SHARDS)] + [
            self.addr(bootstrap_addr)
        ]

    @staticmethod
    def tracker_member(room: int, receiver: str) -> str:
        """A receiver's member of its address tracker: ``<room> <engine>`` (no engine
        name holds a space), not its key name: the namespace and side are the
        tracker's own, so a member is ~20 characters shorter."""
        return f"{check_room(room)} {receiver}"

    def tracked_key(self, member: str) -> str | None:
        """The receiver key an address tracker's member names, None if it names none;
        a member that is a receiver's key name (as engines before issue 22 wrote them)
        is that key."""
        if member.startswith(self.prefix):
            parsed = self.parse_room_key(member)
            return member if parsed is not None and parsed.side == "rx" else None
        room, sep, engine = member.partition(" ")
        if not sep or not _ROOM.fullmatch(room) or int(room) >= MAX_ROOM or not engine:
            return None
        return self.participant(int(room), "rx", engine)

    def engine(self, engine: str) -> str:
        return f"{self.prefix}engine:{engine}"

    def changed(self, engine: str) -> str:
        """The pub/sub channel of an engine's change notices: a script that changes what
        one of its participants would read next publishes the room id here (``notify``
        in ``scripts/_lib.lua``, which builds the same name from the participant's key),
        so a waiting step polls only the rooms that changed (``kvstate.roles.notices``).
        A channel, not a key: it holds nothing and has no TTL."""
        return f"{self.prefix}changed:{engine}"

    def engines_at(self, bootstrap_addr: str) -> str:
        """Engines registered at a bootstrap address, scored by lease deadline (ms): a
        receiver finds its prefill ranks here without SCAN."""
        return f"{self.prefix}engines_at:{bootstrap_addr}"

    @property
    def ledger(self) -> str:
        return f"{self.prefix}ledger"

    def transfer_stats(self, engine: str) -> str:
        """An engine's transfer counters (kvstate.stats), read by kvstate.ops.metrics."""
        return f"{self.prefix}stats:{engine}"

    def probe(self, tag: int, seq: int = 0) -> str:
        """The monitor's expiry probe: a key set with a 1 ms TTL whose expiry event
        shows that keyspace notifications reach it (no CONFIG GET, which would read
        every setting, passwords included). ``tag`` picks its hash slot (one per node
        of a Cluster), ``seq`` tells one probe's event from the last one's."""
        return f"{self.prefix}probe:{{{tag}}}:{seq}"

    def is_probe(self, key: str) -> bool:
        return key.startswith(f"{self.prefix}probe:")

    # -- all namespaces ----------------------------------------------------------
    @staticmethod
    def every_engine_pattern() -> str:
        """Engine registrations of every namespace (``functions prune`` asks which
        library each names); a match is one only if ``namespace_of`` and ``engine``
        spell it back."""
        return f"{ROOT}*:engine:*"

    # -- patterns and parsing (for SCAN-based tools) ---------------------------
    @property
    def all_pattern(self) -> str:
        return f"{self.prefix}*"

    @property
    def participant_pattern(self) -> str:
        return f"{self.prefix}{{*}}:[tr]x:*"

    def participants_of(self, side: Side, engine: str) -> str:
        """Every room's participant of one engine on one side, as a SCAN pattern (the
        engine name's ``[``/``]``, which names may hold, escaped: taken literally)."""
        literal = re.sub(r"([*?\[\]\\])", r"\\\1", engine)
        return f"{self.prefix}{{*}}:{side}:{literal}"

    @property
    def trace_pattern(self) -> str:
        """Every room's trace (``trace()``)."""
        return f"{self.prefix}{{*}}:trace"

    @property
    def engine_pattern(self) -> str:
        return f"{self.prefix}engine:*"

    @property
    def transfer_stats_pattern(self) -> str:
        return f"{self.prefix}stats:*"

    @property
    def addr_pattern(self) -> str:
        return f"{self.prefix}addr:*"

    def parse_room_key(self, key: str) -> RoomKey | None:
        """The room and kind of a per-room key of this namespace, else None."""
        if not key.startswith(self.prefix + "{"):
            return None
        tag_end = key.find("}:", len(self.prefix))
        if tag_end < 0:
            return None
        tag = key[len(self.prefix) + 1 : tag_end]
        if not _ROOM.fullmatch(tag) or int(tag) >= MAX_ROOM:
            return None
        kind, _, rest = key[tag_end + 2 :].partition(":")
        return RoomKey(key, int(tag), kind, rest)


@dataclass(frozen=True)
class RoomKey:
    """A per-room key read back (``Keys.parse_room_key``): ``kind`` is tx, rx, room,
    aborted or trace (or whatever else a foreign key holds there), ``rest`` what follows
    it: the engine for tx and rx. The parser lives beside the builder above so that the
    two cannot drift apart."""

    key: str
    room: int
    kind: str
    rest: str = ""

    @property
    def side(self) -> Side | None:
        """tx or rx for a participant key, else None."""
        return schema.side_of(self.kind)

    @property
    def engine(self) -> str:
        """The engine a participant key is about ('' for the others)."""
        return self.rest if self.kind in ("tx", "rx") else ""

    @property
    def participant(self) -> tuple[Side, str] | None:
        """(side, engine) of a participant key, else None."""
        side = self.side
        return None if side is None else (side, self.rest)
