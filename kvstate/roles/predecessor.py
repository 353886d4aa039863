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
from kvstate.store import Store, command_call

log = logging.getLogger(__name__)


def clear_predecessor(store: Store, side: Side, engine: str) -> list[int]:
    """Fail and clear the rooms a previous process registered as ``engine`` left on
    ``side``; returns the rooms. Run right after registering, before this rank
    creates any room of its own."""
    k = store.keys
    rooms: list[int] = []
    for key in list(store.scan(k.participants_of(side, engine))):
        parsed = k.parse_room_key(key)
        if parsed is None or parsed.participant != (side, engine):
            continue
        room = parsed.room
        try:
            raw = store.execute([command_call("HGETALL", key)])[0] or {}
            fields = {k.decode("utf-8", "replace"): v for k, v in dict(raw).items()}
            addr = fields.get(PEER_ADDR)
            # a receiver's infos went to the senders it bound (peer:<engine>), whether
            # or not they exist yet; any sender listed in the room may have been bound
            # by a lookup whose answer was lost
            senders = set(bindings(fields))
            senders |= {
                m.engine
                for m in (parse_member(x) for x in store.members(room))
                if m is not None and m.side == "tx"
            }
            store.abort(room, f"{engine} restarted: its previous process left this room")
            calls = store.clear_calls(
                room,
                side,
                engine,
                sorted(senders) if side == "rx" else (),
                addr.decode() if isinstance(addr, bytes) else None,
            )
            store.clear_many([calls], partial=False)
            rooms.append(room)
        except KVStateError as exc:  # the keys keep their TTL; start anyway
            log.warning("room %s left by %s's predecessor: %s", room, engine, exc)
    if rooms:
        log.info("%s: cleared %d room(s) its previous process left", engine, len(rooms))
    return rooms


__all__ = ["clear_predecessor"]
