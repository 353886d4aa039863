"""The rank's live participants by room: what its batches, its heartbeat and its
participants' own calls share (the heartbeat runs on a thread of its own, hence the
lock). One participant per room on a rank; a cleared one leaves the table."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TypeVar

from kvstate.errors import KVStateError
from kvstate.keys import check_room
from kvstate.roles.contract import Step

_S = TypeVar("_S", bound=Step)


class Participants:
    """Room -> live participant, held through the ``Step`` protocol only."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._live: dict[int, Step] = {}

    def keep(self, part: _S) -> _S:
        with self._lock:
            self._live[part.room] = part
        return part

    def forget(self, part: Step) -> None:
        with self._lock:
            if self._live.get(part.room) is part:
                del self._live[part.room]

    def get(self, room: int) -> Step | None:
        """The live participant of ``room``, None when there is none (or it cleared)."""
        with self._lock:
            part = self._live.get(room)
        return None if part is None or part.cleared else part

    def all(self) -> list[Step]:
        with self._lock:
            return list(self._live.values())

    def rooms(self) -> list[int]:
        with self._lock:
            return sorted(self._live)

    def resolve(self, rooms: Iterable[object], op: str) -> list[tuple[int, Step | None]]:
        """Each room with its live participant: a room without one is polled bare (poll),
        or refused before anything is sent (any other operation)."""
        out: list[tuple[int, Step | None]] = []
        for room in rooms:
            r = check_room(room)
            part = self.get(r)
            if part is None and op != "poll":
                raise KVStateError(
                    f"room {r}: {self.engine} has no live participant for it; {op}_many "
                    "takes the rooms of this manager's senders or receivers (not cleared)"
                )
            out.append((r, part))
        return out


__all__ = ["Participants"]
