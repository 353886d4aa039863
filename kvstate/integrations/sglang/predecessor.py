"""What a killed rank left in Redis, cleared by the rank that restarts under its name.

A SIGKILLed decode leaves its receivers behind (a transfer that landed but was never
cleared, rooms the prefill already failed); a killed prefill its senders. Their keys
carry the room TTL, but until then they hold the room and its other side waits. The
registry refuses a second live engine under one name, so when a rank has registered,
every participant under its engine name belongs to a dead predecessor: fail the room
(the other side learns why on its next poll) and delete the predecessor's part.
One SCAN of the participant keys, once per rank start.
"""

from __future__ import annotations

import logging
import re

from kvstate.errors import KVStateError
from kvstate.schema import PEER_ADDR, Side, parse_member
from kvstate.store import Store

log = logging.getLogger(__name__)

_GLOB = re.compile(r"([*?\[\]\\])")


def clear_predecessor(store: Store, side: Side, engine: str) -> list[int]:
    """Fail and clear the rooms a previous process registered as ``engine`` left on
    ``side`` (``tx``/``rx``); returns the rooms. Call right after registering, before
    this rank creates any room of its own."""
    k = store.keys
    escaped = _GLOB.sub(r"[\1]", engine)  # the engine name, literally, in a SCAN pattern
    pattern = f"{k.prefix}{{*}}:{side}:{escaped}"
    rooms: list[int] = []
    for key in list(store.scan(pattern)):
        parsed = k.parse_room_key(key)
        if parsed is None or parsed.participant != (side, engine):
            continue
        room = parsed.room
        try:
            fields = store.execute([store.read_hash(key)])[0] or {}
            peer = fields.get(PEER_ADDR.encode()) if isinstance(fields, dict) else None
            senders = [
                m.engine
                for m in (parse_member(x) for x in store.members(room))
                if m is not None and m.side == "tx"
            ]
            store.abort(room, f"{engine} restarted: its previous process left this room")
            calls = store.clear_calls(
                room,
                side,
                engine,
                senders if side == "rx" else (),
                peer.decode() if isinstance(peer, bytes) else None,
            )
            store.clear_many([calls], partial=False)
            rooms.append(room)
        except KVStateError as exc:  # the keys keep their TTL; start anyway
            log.warning("room %s left by %s's predecessor: %s", room, engine, exc)
    if rooms:
        log.info("%s: cleared %d room(s) its previous process left", engine, len(rooms))
    return rooms
