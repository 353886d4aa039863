"""Which rooms a waiting step polls (docs/design.md, "Change notices"; issue 33 target
3). A script that changes what another participant would read at its next poll
publishes the room id on that participant's engine channel (``notify`` in
``scripts/_lib.lua``); the rank drains its channel each step (no round trip) and polls
only the rooms named there, rooms never polled, rooms not waiting, and every room whose
last poll is older than the sweep interval: ``poll.lua`` decides timeouts when it runs
and a poll refreshes nothing else a waiting room needs, so the sweep keeps timeouts
firing (within the interval) even where notices were lost. Any doubt polls everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvstate.poll import KVPoll
from kvstate.roles.contract import Step
from kvstate.store import EVERYTHING, ChangeFeed


class Notices:
    """A rank's change notices and each room's last poll (monotonic seconds)."""

    def __init__(
        self,
        feed: ChangeFeed | None,
        sweep: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feed = feed
        self.sweep = sweep
        self._clock = clock
        self._polled: dict[int, float] = {}

    def select(
        self, parts: list[tuple[int, Step | None]]
    ) -> tuple[list[tuple[int, Step | None]], dict[int, KVPoll]]:
        """(the rooms this step polls, room -> the last status of each one it need not
        poll). ``drain()`` runs once per step, every step, so notices never pile up."""
        changed = self.feed.drain() if self.feed is not None else EVERYTHING
        if changed is EVERYTHING:
            return parts, {}
        now = self._clock()
        send: list[tuple[int, Step | None]] = []
        kept: dict[int, KVPoll] = {}
        for room, p in parts:
            last = self._polled.get(room)
            due = last is None or room in changed or now - last >= self.sweep
            if p is None or due or not p.waiting:  # not waiting: it has something to write
                send.append((room, p))
            else:
                kept[room] = p.status
        return send, kept

    def polled(self, rooms: Iterable[int]) -> None:
        """These rooms' polls were answered now."""
        now = self._clock()
        for room in rooms:
            self._polled[room] = now

    def forget(self, room: int) -> None:
        """The room's participant left this rank."""
        self._polled.pop(room, None)

    def close(self) -> None:
        """Drop the subscription; every later step polls every room."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None


__all__ = ["Notices"]
