"""Read-side views of room state for operators: participants, rooms, engines, census.

Nothing here writes. Ages are computed against the Redis server clock (``TIME``),
never this host's (design rule 9), so a view taken from a laptop with a skewed
clock still shows true ages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstate import schema
from kvstate.errors import CorruptStateError
from kvstate.keys import ROOT, namespace_of
from kvstate.ops import reads
from kvstate.ops.infos import info_json
from kvstate.poll import KVPoll
from kvstate.schema import Side
from kvstate.store import Call, Store

if TYPE_CHECKING:  # the codec (msgpack, numpy) loads when a transfer info is decoded
    from kvstate.codec import TransferInfo

BATCH = 500
# Upper bounds (ms) of the age buckets that `top` and the metrics share.
AGE_BUCKETS: tuple[tuple[int | None, str], ...] = (
    (10_000, "<10s"),
    (60_000, "10s-1m"),
    (300_000, "1m-5m"),
    (None, ">5m"),
)
STATUSES: tuple[str, ...] = tuple(KVPoll.__members__)
WRONG_TYPE = "<wrong Redis type>"  # the status shown for a participant key that is no hash


def age_bucket(age_ms: int) -> str:
    for limit, name in AGE_BUCKETS:
        if limit is None or age_ms < limit:
            return name
    return AGE_BUCKETS[-1][1]


def _int(value: str | None) -> int | None:
    """A stored count as the scripts read it; None when they would refuse it."""
    return schema.parse_count(value, 0, schema.MAX_COUNT)


@dataclass(frozen=True)
class StoredParticipant:
    """One participant as stored in Redis, read at ``now_ms`` (server clock) by the
    operator tools (not ``kvstate.roles.Participant``, the engine's side of a room)."""

    key: str
    room: int
    side: Side
    engine: str
    fields: dict[str, str]
    pttl_ms: int
    now_ms: int

    @property
    def member(self) -> str:
        """Its member (field) in the room hash."""
        return schema.member(self.side, self.engine)

    @property
    def status(self) -> str:
        return self.fields.get(schema.STATUS, "")

    @property
    def valid(self) -> bool:
        return self.status in KVPoll.__members__

    @property
    def poll(self) -> KVPoll | None:
        return KVPoll[self.status] if self.valid else None

    @property
    def terminal(self) -> bool:
        p = self.poll
        return p is not None and p.terminal

    @property
    def reason(self) -> str:
        return self.fields.get(schema.REASON, "")

    @property
    def created_ms(self) -> int | None:
        return self._time(self.fields.get(schema.CREATED_MS))

    @property
    def since_ms(self) -> int | None:
        return self._time(schema.since(self.fields))

    def _time(self, value: str | None) -> int | None:
        """A stored server time, None where the scripts would refuse it (design rule 7)."""
        return schema.parse_count(value, schema.MIN_TIME_MS, self.now_ms + schema.MAX_SKEW_MS)

    @property
    def corrupt_fields(self) -> list[str]:
        """The numeric fields the scripts would refuse as corrupt (kvstate.schema)."""
        return schema.corrupt_fields(self.fields, self.now_ms) if self.valid else []

    @property
    def age_ms(self) -> int | None:
        c = self.created_ms
        return None if c is None else max(0, self.now_ms - c)

    @property
    def in_status_ms(self) -> int | None:
        s = self.since_ms
        return None if s is None else max(0, self.now_ms - s)

    @property
    def bindings(self) -> dict[str, str]:
        """Peer engine -> incarnation this receiver is bound to."""
        return schema.bindings(self.fields)

    def timeout_ms(self) -> tuple[str, int] | None:
        """(name, limit) of the timeout that applies in the current status, if any."""
        timeout = schema.STATUS_TIMEOUTS.get(self.status)
        if timeout is None:
            return None
        name, at = timeout
        limits = schema.timeouts_of(self.fields)
        limit = None if limits is None else limits[at]
        return None if not limit or limit <= 0 else (name, limit)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "room": self.room,
            "side": self.side,
            "engine": self.engine,
            "status": self.status,
            "reason": self.reason,
            "age_ms": self.age_ms,
            "in_status_ms": self.in_status_ms,
            "ttl_ms": self.pttl_ms,
            "peer_addr": self.fields.get(schema.PEER_ADDR, ""),
            "peers": _int(self.fields.get(schema.PEERS)),
            "bindings": self.bindings,
            "fields": self.fields,
        }


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}


def read_participants(store: Store, keys: Sequence[str], now_ms: int) -> list[StoredParticipant]:
    """HGETALL + PTTL of participant keys, in batches (one round trip per node each);
    keys that are gone, or not participant keys, are left out."""
    out: list[StoredParticipant] = []
    for start in range(0, len(keys), BATCH):
        chunk = keys[start : start + BATCH]
        try:
            raw = store.execute([c for key in chunk for c in _reads(store, key)])
        except CorruptStateError:  # a key of the wrong type: read this batch key by key
            raw = []
            for key in chunk:
                try:
                    raw += store.execute(_reads(store, key))
                except CorruptStateError:
                    pttl = store.execute([reads.ttl_of(key)])[0]
                    raw += [{schema.STATUS.encode(): WRONG_TYPE.encode()}, pttl]
        for i, key in enumerate(chunk):
            h, pttl = raw[2 * i], raw[2 * i + 1]
            parsed = store.keys.parse_room_key(key)
            part = None if parsed is None else parsed.participant
            if not h or parsed is None or part is None:
                continue
            side, engine = part
            out.append(
                StoredParticipant(key, parsed.room, side, engine, _text(h), int(pttl), now_ms)
            )
    return out


def _reads(store: Store, key: str) -> list[Call]:
    return [reads.hash_of(key), reads.ttl_of(key)]


def scan_participants(store: Store) -> Iterator[StoredParticipant]:
    """Every participant of the namespace (SCAN, never KEYS), batch by batch."""
    now = store.server_time_ms()
    batch: list[str] = []
    for key in store.scan(store.keys.participant_pattern):
        batch.append(key)
        if len(batch) >= BATCH:
            yield from read_participants(store, batch, now)
            batch = []
    if batch:
        yield from read_participants(store, batch, now)


@dataclass
class Census:
    """Counts of participants by (side, status), and of non-terminal (in flight) ones by
    age bucket and by engine (engine -> (side, status) -> count: an engine's load)."""

    by_status: dict[tuple[str, str], int] = field(default_factory=dict)
    inflight_by_age: dict[str, int] = field(default_factory=dict)
    inflight_by_engine: dict[str, dict[tuple[str, str], int]] = field(default_factory=dict)
    total: int = 0

    def add(self, p: StoredParticipant) -> None:
        self.total += 1
        k = (p.side, p.status if p.valid else "corrupt")
        self.by_status[k] = self.by_status.get(k, 0) + 1
        if p.valid and not p.terminal:
            b = age_bucket(p.age_ms or 0)
            self.inflight_by_age[b] = self.inflight_by_age.get(b, 0) + 1
            load = self.inflight_by_engine.setdefault(p.engine, {})
            load[k] = load.get(k, 0) + 1

    def load_json(self, engine: str) -> dict[str, Any]:
        """One engine's rooms in flight: their total and a count per side:status."""
        load = self.inflight_by_engine.get(engine, {})
        return {
            "total": sum(load.values()),
            "by_status": {f"{s}:{st}": n for (s, st), n in sorted(load.items())},
        }

    @classmethod
    def of(cls, participants: Iterable[StoredParticipant]) -> Census:
        c = cls()
        for p in participants:
            c.add(p)
        return c

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_status": {f"{s}:{st}": n for (s, st), n in sorted(self.by_status.items())},
            "inflight_by_age": {name: self.inflight_by_age.get(name, 0) for _, name in AGE_BUCKETS},
        }


@dataclass
class RoomView:
    """Everything stored for one room, decoded for `kvstate show`."""

    room: int
    now_ms: int
    members: list[str]
    participants: list[StoredParticipant]
    infos: dict[str, dict[str, TransferInfo | str]]  # sender -> receiver -> info or error
    acks: dict[str, list[str]]  # receiver -> senders that acked
    aborted: str | None = None  # the failure mark's reason, if the room failed
    aborted_ttl_ms: int | None = None
    traced: bool = False  # the room has a trace (kvstate trace ROOM), even once cleared
    held_until_ms: int | None = None  # a decode engine holds it queued until then (hold.lua)
    corrupt: list[str] = field(default_factory=list)  # what does not read: key, why
    aborted_named: list[str] = field(default_factory=list)  # the failed request's members

    @property
    def empty(self) -> bool:
        """Nothing at all is stored for the room (not even an abort mark)."""
        return not (
            self.members or self.participants or self.infos or self.acks or self.corrupt
        ) and (self.aborted is None)

    @property
    def unindexed(self) -> list[str]:
        """Participants the room hash does not list (abort cannot reach them)."""
        return [p.member for p in self.participants if p.member not in self.members]

    @property
    def missing_members(self) -> list[str]:
        """Room-hash members whose participant hash is gone (a clear half done)."""
        present = {p.member for p in self.participants}
        return [m for m in self.members if m not in present]

    def to_json(self, limit: int = 1000) -> dict[str, Any]:
        """The view; each list at most ``limit`` long, with ``<name>_more`` saying how
        many were left out (a hostile room hash may hold thousands)."""
        infos: dict[str, dict[str, Any]] = {}
        for sender, per in self.infos.items():
            infos[sender] = {}
            for receiver, info in per.items():
                infos[sender][receiver] = (
                    {"error": info} if isinstance(info, str) else info_json(info)
                )
        lists: dict[str, list[Any]] = {
            "members": self.members,
            "missing_members": self.missing_members,
            "unindexed": self.unindexed,
            "participants": [p.to_json() for p in self.participants[:limit]],
        }
        cut: dict[str, Any] = {}
        for name, items in lists.items():
            cut[name] = items[:limit]
            whole = len(self.participants) if name == "participants" else len(items)
            if whole > limit:
                cut[f"{name}_more"] = whole - limit
        return {
            "room": self.room,
            **cut,
            "transfer_infos": infos,
            "acks": {r: senders[:limit] for r, senders in self.acks.items()},
            "aborted": None
            if self.aborted is None
            else {
                "reason": self.aborted,
                "ttl_ms": self.aborted_ttl_ms,
                "participants": self.aborted_named[:limit],
            },
            "traced": self.traced,
            "held_until_ms": self.held_until_ms,
            "corrupt": self.corrupt,
        }


def room_view(store: Store, room: int) -> RoomView:
    """Read a room through its room hash and the keys its participants name (no SCAN)."""
    k = store.keys
    now = store.server_time_ms()
    corrupt: list[str] = []
    fields: Any = store.execute([reads.room_fields(store.keys, room)], partial=True)[0]
    if isinstance(fields, CorruptStateError):  # not a hash: said, and the rest read
        corrupt.append(f"{k.room_hash(room)}: not a hash (no kvstate code wrote it)")
        fields = {}
    members: list[str] = []
    held_until: int | None = None
    infos: dict[str, dict[str, TransferInfo | str]] = {}
    acks: dict[str, list[str]] = {}
    key = k.room_hash(room)
    for name, value in sorted(fields.items()):
        f = schema.parse_room_field(name)
        if f is None or f.kind in schema.SIDES:
            members.append(name)  # a foreign field too: abort names it corrupt
        elif f.kind == "xfer":
            infos.setdefault(f.engine, {})[f.peer] = _decode_info(key, name, f.peer, value)
        elif f.kind == "hold":
            held_until = schema.parse_count(value, 0, schema.MAX_COUNT + now)
        else:
            acks[f.engine] = sorted(schema.ack_list(value or ""))
    parts = read_participants(store, _participant_keys(store, room, members), now)
    raw = store.execute(
        [*reads.mark_of(store.keys, room), reads.exists(k.trace(room))], partial=True
    )
    mark, mark_ttl, traced = raw
    if isinstance(mark, CorruptStateError):
        corrupt.append(f"{k.aborted(room)}: not a hash (no kvstate code wrote it)")
        mark = None
    parts.sort(key=lambda p: (p.side != "tx", p.engine))
    aborted, named = mark if mark is not None else (None, [])
    return RoomView(
        room,
        now,
        members,
        parts,
        infos,
        acks,
        aborted,
        None if mark is None else int(mark_ttl),
        bool(traced),
        held_until,
        corrupt,
        aborted_named=named,
    )


def _participant_keys(store: Store, room: int, members: list[str]) -> list[str]:
    """The room's participant keys: from its room hash, else (the hash expired
    before its participants?) the slow way, by SCAN."""
    k = store.keys
    keys = [k.participant(room, *part) for m in members if (part := schema.parse_member(m))]
    if keys:
        return keys
    return [
        key
        for key in store.scan(k.room_prefix(room) + "*")
        if (parsed := k.parse_room_key(key)) is not None and parsed.side is not None
    ]


def _decode_info(key: str, name: str, receiver: str, raw: bytes) -> TransferInfo | str:
    """One transfer info of the room hash, or why it does not decode."""
    try:
        from kvstate.codec import TransferInfo  # only `show` decodes: see above

        return TransferInfo.decode(receiver, raw, key, name)
    except CorruptStateError as exc:
        return str(exc)


def holds_keys(store: Store) -> bool:
    """Whether the namespace holds any kvstate key at all (SCAN, stops at the first)."""
    return next(iter(store.scan(store.keys.all_pattern)), None) is not None


def namespaces(store: Store, max_keys: int = 200_000) -> tuple[list[str], bool]:
    """The namespaces that hold kvstate keys (SCAN of every kvstate key, up to
    ``max_keys`` of them); the flag says whether the scan stopped early."""
    found: set[str] = set()
    for i, key in enumerate(store.scan(ROOT + "*")):
        if i >= max_keys:
            return sorted(found), True
        ns = namespace_of(key)
        if ns is not None:
            found.add(ns)
    return sorted(found), False
