"""Which rooms a waiting step polls (docs/design.md, "Change notices"; issue 33 target
3). A script that changes what another participant would read at its next poll
publishes the room id on that participant's engine channel (``notify`` in
``scripts/_lib.lua``); the rank drains its channel each step (no round trip) and polls
only the rooms named there, rooms never answered, rooms not waiting, and every room
whose last answer is older than the sweep interval: ``poll.lua`` decides timeouts when
it runs and a poll refreshes nothing else a waiting room needs, so the sweep keeps
timeouts firing (within the interval) even where notices were lost. Any doubt polls
everything. What is due is kept as it happens (a set, and the answers oldest first), so
that ``due()`` costs the rooms that moved, not the rooms held.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvstate.poll import KVPoll
from kvstate.roles.contract import Step
from kvstate.roles.table import Participants
from kvstate.store import EVERYTHING, ChangeFeed


class Notices:
    """A rank's change notices, each room's last answer (monotonic seconds, oldest
    first) and the rooms its next step polls whatever the notices say."""

    def __init__(
        self,
        table: Participants,
        feed: ChangeFeed | None,
        sweep: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.feed = feed
        self.sweep = sweep
        self._clock = clock
        # a participant's clear (forget) may run on another thread than the step
        self._lock = threading.Lock()
        self._answered: OrderedDict[int, float] = OrderedDict()
        # named by a notice, never answered, not waiting at its last answer, or asked
        # for; left at the answer that finds it waiting (a failed poll leaves it here)
        self._due: set[int] = set()

    def ask(self, room: int) -> None:
        """The next step polls ``room``: a participant was made here, or its last poll
        went unanswered."""
        with self._lock:
            self._due.add(room)

    def _changed(self) -> set[int] | None:
        """The rooms named since the last step, kept due until answered; EVERYTHING
        where notices may have been lost. Once per step, every step, so notices never
        pile up."""
        changed = self.feed.drain() if self.feed is not None else EVERYTHING
        if changed is not EVERYTHING:  # a room this rank does not hold is dropped
            held = [r for r in changed if self.table.get(r) is not None]
            with self._lock:
                self._due.update(held)
        return changed

    def select(
        self, parts: list[tuple[int, Step | None]]
    ) -> tuple[list[tuple[int, Step | None]], dict[int, KVPoll]]:
        """``poll_many``: (the rooms this step polls, room -> the last status of each
        one it need not poll)."""
        if self._changed() is EVERYTHING:
            return parts, {}
        now = self._clock()
        send: list[tuple[int, Step | None]] = []
        kept: dict[int, KVPoll] = {}
        for room, p in parts:
            last = self._answered.get(room)
            due = last is None or room in self._due or now - last >= self.sweep
            if p is None or due or not p.waiting:  # not waiting: it has something to write
                send.append((room, p))
            else:
                kept[room] = p.status
        return send, kept

    def due(self) -> list[tuple[int, Step | None]]:
        """``poll_changed``: the live participants this step polls, in the time of the
        rooms due (all of them where notices may have been lost)."""
        if self._changed() is EVERYTHING:
            return [(p.room, p) for p in self.table.all() if not p.cleared]
        now = self._clock()
        with self._lock:
            rooms = set(self._due)
            for room, last in self._answered.items():  # oldest answer first
                if now - last < self.sweep:
                    break
                rooms.add(room)
        out: list[tuple[int, Step | None]] = []
        for room in sorted(rooms):
            p = self.table.get(room)
            if p is None:  # cleared since
                self.forget(room)
            else:
                out.append((room, p))
        return out

    def quiet(self) -> bool:
        """``due()`` would answer no room now: no notice, no room asked for, none past
        the sweep. Drains nothing (a step may skip its poll on it)."""
        if self.feed is None or not self.feed.quiet():
            return False
        now = self._clock()
        with self._lock:
            oldest = next(iter(self._answered.values()), None)
            return not self._due and (oldest is None or now - oldest < self.sweep)

    def polled(self, parts: Iterable[tuple[int, Step | None]]) -> None:
        """These rooms' polls (or any batch's calls) were answered now."""
        now = self._clock()
        answered = [(room, p.waiting) for room, p in parts if p is not None]  # not bare
        with self._lock:
            for room, waiting in answered:
                self._answered[room] = now
                self._answered.move_to_end(room)
                if waiting:
                    self._due.discard(room)
                else:
                    self._due.add(room)

    def forget(self, room: int) -> None:
        """The room's participant left this rank."""
        with self._lock:
            self._answered.pop(room, None)
            self._due.discard(room)

    def close(self) -> None:
        """Drop the subscription; every later step polls every room."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None


__all__ = ["Notices"]
