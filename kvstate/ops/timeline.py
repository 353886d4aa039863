"""A room's trace read back as a timeline: each step with the time since the one before,
and the room's named phases (``kvstate trace ROOM``).

The steps come from the list the scripts write (kvstate.trace); their times are the
Redis server's clock, so the gaps compare steps taken by different
hosts without comparing their clocks (design rule 9).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstate import schema
from kvstate.store import Call, Store, command_call
from kvstate.trace import TraceEntry, traceparent

TERMINAL_FAILURE = ("Failed", schema.EV_ABORT)


@dataclass(frozen=True)
class Phase:
    """A stretch of the room's life between two milestones (server ms). An ``open``
    phase is the one a live room is in: it runs to the server's current time."""

    name: str
    start_ms: int
    end_ms: int
    open: bool = False

    @property
    def ms(self) -> int:
        return self.end_ms - self.start_ms

    def label(self) -> str:
        return f"{self.name} {self.ms} ms" + (" so far" if self.open else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ms": self.ms,
            "from_ms": self.start_ms,
            "to_ms": self.end_ms,
            "open": self.open,
        }


@dataclass(frozen=True)
class Timeline:
    """Everything ``kvstate trace`` prints about one room."""

    room: int
    entries: list[TraceEntry]
    ttl_ms: int | None  # PTTL of the trace list
    now_ms: int | None = None  # the server's clock when read, for a live room; else None
    # the serving requests' trace contexts the engines passed: (side, engine, traceparent)
    contexts: tuple[tuple[str, str, str], ...] = ()
    stored: int = 0  # entries the list holds: more than were read when it was cut

    @property
    def live(self) -> bool:
        """Whether the room still had participants when read: its last phase is open."""
        return self.now_ms is not None and bool(self.entries)

    @property
    def empty(self) -> bool:
        return not self.entries

    @property
    def start_ms(self) -> int:
        return self.entries[0].ms if self.entries else 0

    @property
    def total_ms(self) -> int:
        """First step to last; for a live room, first step to now (so far)."""
        if not self.entries:
            return 0
        end = self.now_ms if self.live and self.now_ms is not None else self.entries[-1].ms
        return max(end, self.entries[-1].ms) - self.entries[0].ms

    def deltas(self) -> list[int | None]:
        """Each step's time since the step before (None for the first)."""
        if not self.entries:
            return []
        out: list[int | None] = [None]
        out += [b.ms - a.ms for a, b in zip(self.entries, self.entries[1:], strict=False)]
        return out

    def _first(self, side: str | None, *events: str) -> TraceEntry | None:
        return next((e for e in self.entries if _is(e, side, events)), None)

    def _last(self, side: str | None, *events: str) -> TraceEntry | None:
        return next((e for e in reversed(self.entries) if _is(e, side, events)), None)

    @property
    def failure(self) -> TraceEntry | None:
        """The first step that failed a participant (a Failed status or an abort)."""
        return self._first(None, *TERMINAL_FAILURE)

    @property
    def outcome(self) -> str:
        """Success, Failed (with the first reason), in flight, or cleared early."""
        fail = self.failure
        if fail is not None:
            return f"Failed: {fail.fields.get(schema.REASON, '') or fail.event}"
        if self._last("rx", "Success") or self._last("tx", "Success"):
            return "Success"
        if self._last(None, schema.EV_CLEARED):
            return "cleared before Success"
        return "in flight"

    def phases(self) -> list[Phase]:
        """The room's phases, each from one milestone to the next: bootstrap (the first
        step -> the last sender holds every receiver's transfer info: WaitingForInput),
        waiting for input (-> the first sender Transferring: the prefill computing),
        transfer (-> the last Success), until clear (-> the last cleared). A failure
        ends the phase it fell in ("transfer until failure"). A live room (read while it
        had participants) has the phases it reached, then the one it is in, open: from
        its last milestone to the server's current time."""
        if not self.entries:
            return []
        ready = self._last("tx", "WaitingForInput")
        for e in self.entries:  # a sender created after every receiver published
            waiting = e.side == "tx" and e.fields.get(schema.STATUS) == "WaitingForInput"
            if waiting and (ready is None or _after(e, ready)):
                ready = e
        ready = ready or self._last("rx", "WaitingForInput")
        marks = [
            ("bootstrap", ready),
            ("waiting for input", self._first("tx", "Transferring")),
            ("transfer", self._last("rx", "Success") or self._last("tx", "Success")),
        ]
        fail = self.failure
        out: list[Phase] = []
        at = self.entries[0]
        current = "until clear"  # the phase a live room is in
        for name, mark in marks:
            if fail is not None and (mark is None or _after(mark, fail)):
                out.append(Phase(f"{name} until failure", at.ms, fail.ms))
                at = fail
                break
            if mark is None:
                current = name
                break
            out.append(Phase(name, at.ms, mark.ms))
            at = mark
        if self.live and self.now_ms is not None:
            out.append(Phase(current, at.ms, max(self.now_ms, at.ms), open=True))
            return out
        cleared = self._last(None, schema.EV_CLEARED)
        if cleared is not None and _after(cleared, at):
            out.append(Phase("until clear", at.ms, cleared.ms))
        return out

    @property
    def unread(self) -> int:
        """Entries the list holds past those read (a trace no room of kvstate's makes)."""
        return max(0, self.stored - len(self.entries))

    def summary(self) -> str:
        """One line: outcome, total, each phase's time."""
        if not self.entries:
            return f"room {self.room}: no trace"
        parts = ", ".join(p.label() for p in self.phases())
        span = "since the first step, so far (live)" if self.live else "from first to last step"
        return (
            f"room {self.room}: {self.outcome}; {self.total_ms} ms {span}"
            + (f": {parts}" if parts else "")
            + f"; {len(self.entries)} steps"
            + (f" read, {self.unread} more not read" if self.unread else "")
        )

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        """The timeline; at most ``limit`` steps, ``steps_more`` saying how many more
        the trace holds."""
        steps = []
        pairs = list(zip(self.entries, self.deltas(), strict=True))[:limit]
        for e, delta in pairs:
            steps.append({**e.to_json(), "delta_ms": delta, "since_start_ms": e.ms - self.start_ms})
        return {
            "room": self.room,
            "outcome": self.outcome if self.entries else None,
            "live": self.live,
            "now_ms": self.now_ms if self.live else None,
            "total_ms": self.total_ms,
            "phases": [p.to_json() for p in self.phases()],
            "request_traces": [
                {"side": side, "engine": engine, "traceparent": tp}
                for side, engine, tp in self.contexts
            ],
            "steps": steps,
            "steps_more": max(self.stored, len(self.entries)) - len(steps),
            "ttl_ms": self.ttl_ms,
        }


def _is(e: TraceEntry, side: str | None, events: tuple[str, ...]) -> bool:
    return (side is None or e.side == side) and e.event in events


def _after(a: TraceEntry, b: TraceEntry) -> bool:
    """Whether step ``a`` came after step ``b`` (the trace's order)."""
    return (a.ms, a.seq) > (b.ms, b.seq)


READ_MAX = 10_000  # entries of a trace read at most (a room of kvstate's makes dozens)


def read_timeline(store: Store, room: int, most: int = READ_MAX) -> Timeline:
    """The room's trace (its first ``most`` entries), its TTL, whether the room is live
    (its room hash, which lists its participants, exists) and the trace's length, in
    one round trip (one slot); for a live room, the server's clock too (TIME: its open
    phase runs to now, design rule 9). A trace key of the wrong type reads as one
    ``unreadable`` step saying so (the command goes on)."""
    raw, ttl, listed, stored = store.execute(timeline_calls(store, room, most), partial=True)
    live = not isinstance(listed, Exception) and bool(int(listed))
    length = stored if isinstance(stored, int) else 0  # an error: the key is no list
    return timeline_of(room, raw, int(ttl), live, store.server_time_ms, length)


def timeline_calls(store: Store, room: int, most: int = READ_MAX) -> list[Call]:
    """What ``timeline_of`` reads of a room, one slot: its trace (LRANGE, the first
    ``most`` entries), the trace's TTL, whether the room is live (its room hash exists),
    and the trace's length (LLEN)."""
    key = store.keys.trace(room)
    return [
        command_call("LRANGE", key, args=[0, most - 1]),
        command_call("PTTL", key),
        command_call("EXISTS", store.keys.room_hash(room)),
        command_call("LLEN", key),
    ]


def timeline_of(
    room: int,
    raw: list[Any] | Exception | None,
    ttl: int,
    live: bool,
    clock: Callable[[], int] | None = None,
    stored: int = 0,
) -> Timeline:
    """A timeline from a trace list as read (LRANGE): its steps, and apart from them the
    serving requests' trace contexts the engines recorded (schema.EV_CONTEXT: no step).
    ``clock`` (the server's, ms) is asked for a live room only. ``raw`` an error (the
    key is not a list): one ``unreadable`` step that says so."""
    if isinstance(raw, Exception):
        note = {"raw": f"the trace is not a list: {raw}"}
        return Timeline(room, [TraceEntry(0, 0, "", "", "unreadable", note)], ttl)
    steps, contexts = [], []
    for e in TraceEntry.parse_all(raw or []):
        if e.event == schema.EV_CONTEXT:
            tp = traceparent(e.fields.get(schema.TRACE_PARENT))
            if tp is not None:
                contexts.append((e.side, e.engine, tp))
        else:
            steps.append(e)
    now = clock() if steps and live and clock is not None else None
    unread = max(0, stored - len(raw or []))  # entries past those read (a cut trace)
    return Timeline(room, steps, ttl if steps else None, now, tuple(contexts), len(steps) + unread)
