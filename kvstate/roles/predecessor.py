"""What a killed rank left in Redis, cleared by the rank that restarts under its name.

A SIGKILLed decode leaves its receivers behind (a transfer that landed but was never
cleared, rooms the prefill already failed); a killed prefill its senders. Their keys
carry the room TTL, but until then they hold the room and its other side waits. The
registry refuses a second live engine under one name, so once a rank has registered,
every participant under its engine name belongs to a dead predecessor: fail the room
(the other side learns why on its next poll) and delete the predecessor's part. One
SCAN of the participant keys, once per rank start (``KVManager.clear_predecessor``).
"""

from __future__ import annotations

import logging

from kvstate.errors import KVStateError
from kvstate.keys import Side
from kvstate.schema import PEER_ADDR, bindings, parse_member
from kvstate.store import Call, Store, command_call, member_fields

log = logging.getLogger(__name__)


def clear_predecessor(store: Store, side: Side, engine: str) -> list[int]:
    """Fail and clear the rooms a previous process registered as ``engine`` left on
    ``side``; returns the rooms. Run right after registering, before this rank
    creates any room of its own. Besides the SCAN, four round trips per node whatever
    the rooms' number: their keys and participants read, the rooms aborted (two), the
    predecessor's part cleared. A room that fails keeps its keys' TTL (logged)."""
    k = store.keys
    rooms: list[int] = []
    for key in list(store.scan(k.participants_of(side, engine))):
        parsed = k.parse_room_key(key)
        if parsed is not None and parsed.participant == (side, engine):
            rooms.append(parsed.room)
    if not rooms:
        return []
    calls = []
    for room in rooms:
        calls.append(command_call("HGETALL", k.participant(room, side, engine)))
        calls.append(command_call("HKEYS", k.room_hash(room)))
    try:
        read = store.execute(calls, partial=True)
        why = f"{engine} restarted: its previous process left this room"
        aborted = store.abort_many(dict.fromkeys(rooms, why))
    except KVStateError as exc:  # the keys keep their TTL; start anyway
        log.warning("%s: the %d room(s) its predecessor left: %s", engine, len(rooms), exc)
        return []
    clears: dict[int, list[Call]] = {}
    for i, room in enumerate(rooms):
        raw, members = read[2 * i], read[2 * i + 1]
        failed = next(
            (r for r in (raw, members, aborted[room]) if isinstance(r, KVStateError)), None
        )
        if failed is not None:
            log.warning("room %s left by %s's predecessor: %s", room, engine, failed)
            continue
        fields = {f.decode("utf-8", "replace"): v for f, v in dict(raw or {}).items()}
        addr = fields.get(PEER_ADDR)
        # a receiver's infos went to the senders it bound (peer:<engine>), whether or
        # not they exist yet; any sender listed in the room may have been bound by a
        # lookup whose answer was lost
        senders = set(bindings(fields))
        senders |= {
            m.engine
            for m in map(parse_member, member_fields(members))
            if m is not None and m.side == "tx"
        }
        clears[room] = store.clear_calls(
            room,
            side,
            engine,
            sorted(senders) if side == "rx" else (),
            addr.decode() if isinstance(addr, bytes) else None,
        )
    try:
        left = store.clear_many(list(clears.values()))
    except KVStateError as exc:
        log.warning("%s: clearing the room(s) its predecessor left: %s", engine, exc)
        return []
    done = []
    for room, error in zip(clears, left, strict=True):
        if error is None:
            done.append(room)
        else:
            log.warning("room %s left by %s's predecessor: %s", room, engine, error)
    if done:
        log.info("%s: cleared %d room(s) its previous process left", engine, len(done))
    return done


__all__ = ["clear_predecessor"]
