"""The reads and repairs the operator tools make (the views, the audit, the demo's
bookkeeping), as Calls the store runs beside others in one round trip: they own their
Redis calls as the registry, the ledger and the stats own theirs (docs/design.md,
"Layers")."""

from __future__ import annotations

from typing import Any

from kvstate import schema
from kvstate.keys import Keys, Side
from kvstate.store import Call, command_call, text_or_none


def hash_of(key: str) -> Call:
    """HGETALL of any kvstate hash (a participant, a room hash, a registration...)."""
    return command_call("HGETALL", key)


def ttl_of(key: str) -> Call:
    """PTTL in ms: -1 no TTL, -2 gone."""
    return command_call("PTTL", key)


def exists(key: str) -> Call:
    return command_call("EXISTS", key)


def type_of(key: str) -> Call:
    """The key's Redis type as text (TYPE): 'none' when it is gone."""
    return command_call("TYPE", key, parse=lambda raw: text_or_none(raw) or "none")


def expire(key: str, ttl_ms: int) -> Call:
    """PEXPIRE: a repair giving a key its TTL back."""
    return command_call("PEXPIRE", key, args=[ttl_ms])


def listed(keys: Keys, room: int, side: Side, engine: str) -> Call:
    """Whether the room hash lists that participant (1 or 0; HGET: an engine user's
    read)."""
    key, member = keys.room_hash(room), schema.member(side, engine)
    return command_call("HGET", key, args=[member], parse=lambda raw: int(raw is not None))


def relist(keys: Keys, room: int, side: Side, engine: str) -> Call:
    """Put a participant back into its room hash (an audit repair), as create.lua
    writes it: the field, with an empty value."""
    return command_call("HSET", keys.room_hash(room), args=[schema.member(side, engine), ""])


def room_fields(keys: Keys, room: int) -> Call:
    """The room hash, field -> value (text; a transfer info's msgpack stays bytes)."""
    return command_call("HGETALL", keys.room_hash(room), parse=_room_fields)


def drop_room_fields(keys: Keys, room: int, *fields: str) -> Call:
    """HDEL of room-hash fields (an audit repair); answers how many were there."""
    return command_call("HDEL", keys.room_hash(room), args=fields)


def acks_of(keys: Keys, room: int, receiver: str) -> Call:
    """The sender engines that finished for one receiver, sorted."""
    key, field = keys.room_hash(room), schema.ack_field(receiver)
    return command_call("HGET", key, args=[field], parse=_ack_list)


def mark_of(keys: Keys, room: int) -> list[Call]:
    """The room's failure mark, (reason, the members it names) or None if it has none,
    and the mark's PTTL."""
    key = keys.aborted(room)
    return [command_call("HGETALL", key, parse=_mark), command_call("PTTL", key)]


def _mark(raw: dict[bytes, bytes]) -> tuple[str, list[str]] | None:
    fields = {k.decode("utf-8", "replace"): v for k, v in raw.items()}
    reason = text_or_none(fields.pop(schema.REASON, None))
    return None if reason is None else (reason, sorted(fields))


def unmark(keys: Keys, room: int) -> Call:
    """Delete a room's failure mark: for an abort that failed nobody because both sides
    had already finished (the demo's bookkeeping), no side of that room will be created
    again, so the mark would only be a key left behind."""
    return command_call("DEL", keys.aborted(room))


def members_of(key: str) -> Call:
    """Every member of an ``addr:`` tracker or ``engines_at:`` index key."""
    return command_call("ZRANGE", key, args=[0, -1])


def untrack(key: str, member: str) -> Call:
    return command_call("ZREM", key, args=[member])


def _room_fields(raw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in dict(raw or {}).items():
        text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        out[text] = value if text.startswith(schema.XFER_PREFIX) else text_or_none(value)
    return out


def _ack_list(raw: Any) -> list[str]:
    return sorted(schema.ack_list(text_or_none(raw) or ""))


__all__ = [
    "acks_of",
    "drop_room_fields",
    "exists",
    "expire",
    "hash_of",
    "listed",
    "mark_of",
    "members_of",
    "relist",
    "room_fields",
    "ttl_of",
    "type_of",
    "unmark",
    "untrack",
]
