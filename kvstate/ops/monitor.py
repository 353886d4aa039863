"""The monitor: it keeps the leak ledger (``kvstate.ops.ledger``) and exports the
metrics.

An expiry deletes the value before anyone can read it, and keyspace
notifications carry only the key name, fire-and-forget. So the monitor keeps
its own memory of the state and uses notifications only to *attribute* a
disappearance:

* Every ``interval`` it SCANs the participant keys and remembers, in memory,
  each one's status, side, engine, created_ms and TTL deadline (server clock).
* It subscribes to ``__keyevent@<db>__:expired`` on every primary (node-local
  on a Cluster) and learns whether expiry events flow by a probe key's own event
  (``_Events``: no CONFIG GET, an admin's); enabling ``notify-keyspace-events Ex``
  with CONFIG SET when they do not and the user may (an admin; existing flags are
  kept).
* With notifications: a participant whose expiry event arrives is *reaped*;
  the ledger gets its last seen status. A participant that vanished without an
  event is held for one more sweep (its event may still be in flight on the
  other connection), then counted as *cleared* and forgotten. An event for a
  key never seen (created and expired between two sweeps) is recorded with
  status ``unknown``.
* Without notifications (off, and CONFIG SET denied; the subscription dropped; or
  the flags turned off since: each sweep's probe tells): a participant that vanished at
  or after its last seen TTL deadline (minus ``slack``) is counted as reaped, one
  that vanished earlier as cleared; so is one held for its event when the sweep
  finds notifications gone. Limit:
  a participant whose TTL was refreshed after the last sweep and that was then
  cleared after the old deadline is misread as reaped; keep ``interval`` well
  below the room TTL. A participant created and reaped between two sweeps is
  not recorded at all in this mode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstate import schema
from kvstate.errors import KVStateError
from kvstate.ops.ledger import Entry, Ledger
from kvstate.ops.metrics import Metrics
from kvstate.ops.views import Census, StoredParticipant, scan_participants
from kvstate.registry import Registry
from kvstate.store import Store, Subscription

log = logging.getLogger(__name__)


@dataclass
class Seen:
    """What the monitor last saw of a participant."""

    room: int
    side: str
    engine: str
    status: str
    created_ms: int | None
    deadline_ms: int | None  # server clock; None when the key had no TTL

    @classmethod
    def of(cls, p: StoredParticipant) -> Seen:
        deadline = p.now_ms + p.pttl_ms if p.pttl_ms >= 0 else None
        return cls(p.room, p.side, p.engine, p.status or "unknown", p.created_ms, deadline)


NOTIFY_SETTING = "notify-keyspace-events"
PROBE_WAIT = 0.25  # s: how long a probe's expiry event may take to arrive


def _has_expiry_flags(flags: str) -> bool:
    """Whether a notify-keyspace-events value sends keyevent expiry events (E and x,
    or E and A, which includes x)."""
    return "E" in flags and ("x" in flags or "A" in flags)


class _Events:
    """Expiry notifications from every primary; ``healthy`` turns False when a
    subscription breaks or the probe's event stops arriving, so the monitor knows its
    attribution has a gap.

    Whether a server sends expiry events is learnt without CONFIG GET (which would read
    every setting, ``requirepass`` included: no user of docs/security.md may): the namespace's
    probe key (``Keys.probe``) is set with a 1 ms TTL on each primary, and read back
    (EXISTS deletes a key past its TTL, and sends its event, at once) until its event
    arrives. Each sweep does it again: the probe planted by the last sweep is read back
    before the sweep drains the events, so its event is among them, or the flags went
    off. Turning them on needs CONFIG SET, an admin's: tried only with ``enable``,
    and where the user may."""

    def __init__(self, store: Store, enable: bool) -> None:
        self.store = store
        self.enable = enable
        self.subs: list[Subscription] = []
        self.healthy = False
        self.note = ""
        self._nodes: list[str] = []  # the primaries subscribed to
        self._probes: dict[str, str] = {}  # probe key -> node, planted, event awaited
        self._tags: dict[str, int] = {}  # node -> the hash tag of its probes
        self._seq = 0  # each probe's own name: an event is that probe's alone
        self._early: set[str] = set()  # keys drained while waiting for a probe's event

    def start(self) -> bool:
        self.close()
        try:
            self._nodes = nodes = self.store.primaries()
            self.subs = [self.store.expiry_events(name) for name in nodes]
            off = self._probe(nodes, PROBE_WAIT)
            if off and self.enable:
                for name in off:
                    if not self._turn_on(name):
                        self.close()
                        return False
                off = self._probe(off, PROBE_WAIT)
            if off:
                self.note = (
                    f"no expiry events from {', '.join(off)}: notify-keyspace-events lacks "
                    "Ex there"
                    + ("" if self.enable else " (--no-notify: not changing it)")
                    + "; an admin turns them on: CONFIG SET notify-keyspace-events Ex"
                )
                self.close()
                return False
        except (OSError, KVStateError) as exc:
            self.note = f"expiry notifications unavailable ({type(exc).__name__}: {exc})"
            self.close()
            return False
        self.healthy = True
        self.note = "expiry notifications on"
        return True

    def _plant(self, nodes: Sequence[str]) -> None:
        for name in nodes:
            if name not in self._tags:
                self._tags[name] = self.store.probe_tag(name)
            self._seq += 1
            key = self.store.keys.probe(self._tags[name], self._seq)
            self.store.plant_probe(key, name)
            self._probes[key] = name

    def _probe(self, nodes: Sequence[str], wait: float) -> list[str]:
        """Plant a probe on each node and read it back until its event arrives, at
        most ``wait`` s; the nodes whose event did not."""
        self._plant(nodes)
        return self._awaited(wait)

    def touch(self) -> None:
        """Read every planted probe back: one past its TTL is deleted, and its event
        sent, now (so that the next drain reads it)."""
        for key, name in list(self._probes.items()):
            self.store.touch_probe(key, name)

    def _awaited(self, wait: float, touch: bool = True) -> list[str]:
        """Drain the events until each planted probe's arrived (read back first with
        ``touch``, and again every few ms: a probe read back within its 1 ms is not
        gone yet), at most ``wait`` s; the nodes whose probe event did not arrive
        (those probes are forgotten)."""
        end = time.monotonic() + wait
        if touch:
            self.touch()
        while self._probes:
            self._early |= self._read()
            if not self._probes or time.monotonic() >= end:
                break
            time.sleep(0.005)
            self.touch()
        off = sorted(set(self._probes.values()))
        self._probes.clear()
        return off

    def _turn_on(self, name: str) -> bool:
        try:
            flags = self.store.config_get(NOTIFY_SETTING, name)
            wanted = "".join(sorted(set(flags) | {"E", "x"}))
            self.store.config_set(NOTIFY_SETTING, wanted, name)
        except KVStateError as exc:
            self.note = (
                f"no expiry events from {name}, and this user may not turn them on "
                f"({exc}); an admin runs CONFIG SET notify-keyspace-events Ex"
            )
            return False
        return True

    def still_on(self) -> bool:
        """Whether every primary still sends expiry events: an operator (or a restart)
        may have turned them off since, and a subscription then stays open but silent.
        The probe planted by the last sweep (none right after ``start()``) must have
        sent its event by now (``touch`` read it back before the sweep's drains); then
        a new one is planted. Marks the events
        unhealthy when one did not, so the next ``start()`` sees to them."""
        if not self.healthy:
            return False
        try:
            off = self._awaited(PROBE_WAIT, touch=False)
            for name in off:
                log.warning("no expiry event from %s: notify-keyspace-events lost Ex?", name)
                self.healthy = False
            if self.healthy:
                self._plant(self._nodes)
        except (OSError, KVStateError) as exc:
            log.warning("cannot probe expiry events: %s", exc)
            self.healthy = False
        return self.healthy

    def _read(self) -> set[str]:
        """Keys whose expiry event is waiting on the subscriptions; probe keys awaited
        are taken off ``_probes`` (not returned: no participant)."""
        out: set[str] = set()
        for sub in self.subs:
            try:
                while (key := sub.next()) is not None:
                    if self.store.keys.is_probe(key):
                        self._probes.pop(key, None)
                    else:
                        out.add(key)
            except (KVStateError, OSError) as exc:
                log.warning("expiry subscription lost: %s", exc)
                self.healthy = False
        return out

    def drain(self) -> set[str]:
        """Keys whose expiry event arrived since the last drain."""
        out, self._early = self._early | self._read(), set()
        return out

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        self.subs = []
        self.healthy = False
        self._probes.clear()


class Monitor:
    """Keeps the ledger and the gauges; ``run()`` loops, ``sweep()`` is one step."""

    def __init__(
        self,
        store: Store,
        interval: float = 5.0,
        *,
        metrics: Metrics | None = None,
        notifications: bool = True,
        audit: Callable[[], dict[str, int]] | None = None,
        audit_interval: float = 60.0,
        slack: float = 0.5,
        on_entry: Callable[[Entry], None] | None = None,
        after_sweep: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.interval = interval
        self.metrics = metrics
        self.ledger = Ledger(store)
        self.events = _Events(store, notifications)
        self.audit = audit
        self.audit_interval = audit_interval
        self.slack_ms = int(slack * 1000)
        self.on_entry = on_entry
        self.after_sweep = after_sweep  # more reads of a good sweep (the ended rooms)
        self.known: dict[str, Seen] = {}
        self._gone: dict[str, Seen] = {}
        self._last_audit = float("-inf")
        self._covered = False
        self.sweeps = 0

    def start(self) -> str:
        """Subscribe to expiry events if possible; returns a note on the mode in use."""
        self._covered = self.events.start()
        return self.events.note

    def sweep(self) -> list[Entry]:
        """One SCAN of the participants; records what was reaped since the last one."""
        covered = self._covered  # events flowed from the previous SCAN until now
        if not self.events.healthy:
            self.events.start()
            covered = False
        else:
            self.events.touch()  # the last probe's event, into the drains below
        expired = self.events.drain()
        current = {p.key: p for p in scan_participants(self.store)}
        expired |= self.events.drain()
        now = self.store.server_time_ms()
        on = self.events.still_on()  # (and a new probe for the next sweep)
        covered = covered and on
        entries = self._expired(expired, current, now)
        # Covered: keys held a sweep ago and still without an event were cleared. Not
        # covered (events lost meanwhile), they are judged by their deadline as well.
        held, self._gone = self._gone, {}
        for key, seen in [*held.items(), *self.known.items()]:
            if key in current or (covered and key in held):
                continue
            if covered:
                self._gone[key] = seen  # its event may still be in flight: wait a sweep
            elif seen.deadline_ms is not None and now >= seen.deadline_ms - self.slack_ms:
                entries.append(self._entry(key, seen, now, "vanished at its TTL deadline"))
        self.known = {k: Seen.of(p) for k, p in current.items()}
        self.sweeps += 1
        self._covered = self.events.healthy
        self.ledger.append(entries)
        if self.metrics is not None:
            self._export(current.values(), entries)
        for e in entries:
            if self.on_entry is not None:
                self.on_entry(e)
        if self.after_sweep is not None:
            self.after_sweep()
        return entries

    def _expired(
        self, expired: set[str], current: dict[str, StoredParticipant], now: int
    ) -> list[Entry]:
        """Entries for the participants whose expiry event arrived; forgets them (from
        ``current`` too: one that expired right after the SCAN read it)."""
        entries: list[Entry] = []
        for key in sorted(expired):
            parsed = self.store.keys.parse_room_key(key)
            part = None if parsed is None else parsed.participant
            if parsed is None or part is None:
                continue
            seen = self.known.pop(key, None) or self._gone.pop(key, None)
            if seen is None and key in current:
                seen = Seen.of(current.pop(key))
            if seen is None:
                seen = Seen(parsed.room, *part, "unknown", None, None)
            entries.append(self._entry(key, seen, now, "expiry event"))
        return entries

    def _entry(self, key: str, seen: Seen, now: int, how: str) -> Entry:
        age = None if seen.created_ms is None else max(0, now - seen.created_ms)
        return Entry("expired", seen.room, seen.side, seen.engine, seen.status, age, key, how)

    def _export(self, participants: Iterable[StoredParticipant], entries: list[Entry]) -> None:
        m = self.metrics
        assert m is not None
        m.set_census(Census.of(participants))
        m.count_reaped(entries)
        m.load_transfers(self.store)
        roles: dict[str, int] = {}
        s = self.store
        prefix = s.keys.engine("")
        engines = [k[len(prefix) :] for k in s.scan(s.keys.engine_pattern)]
        if engines:
            registry = Registry(s)
            calls = [registry.field_call(e, schema.ROLE) for e in engines]
            for role in s.execute(calls, partial=True):
                if isinstance(role, str):  # not a registration that is no hash, nor gone
                    role = role if role in ("prefill", "decode") else "other"
                    roles[role] = roles.get(role, 0) + 1
        m.set_engines(roles)
        m.sweep_succeeded()

    def _maybe_audit(self) -> None:
        if self.audit is None or self.metrics is None:
            return
        if time.monotonic() - self._last_audit < self.audit_interval:
            return
        self._last_audit = time.monotonic()
        self.metrics.set_findings(self.audit())

    def run(
        self,
        stop: threading.Event | None = None,
        duration: float | None = None,
        *,
        on_down: Callable[[KVStateError], None] | None = None,
        on_back: Callable[[float, int], None] | None = None,
    ) -> None:
        """Sweep every ``interval`` until ``stop`` is set or ``duration`` passes.
        A Redis outage is retried, never fatal: the monitor outlives it. Its first
        failed sweep is told to ``on_down`` (the error), the first good one after it to
        ``on_back`` (seconds down, sweeps failed); both log by default."""
        stop = stop or threading.Event()
        end = None if duration is None else time.monotonic() + duration
        down_since: float | None = None
        failed = 0
        try:
            while not stop.is_set():
                try:
                    self.sweep()
                    self._maybe_audit()
                    if down_since is not None:
                        (on_back or _log_back)(time.monotonic() - down_since, failed)
                        down_since, failed = None, 0
                except KVStateError as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        (on_down or _log_down)(exc)
                    failed += 1
                    self.events.healthy = False
                    if self.metrics is not None:
                        self.metrics.sweep_failed()  # drops the audit's gauges too:
                        self._last_audit = float("-inf")  # audit again once back
                if end is not None and time.monotonic() >= end:
                    break
                wait = (
                    self.interval
                    if end is None
                    else min(self.interval, max(0.0, end - time.monotonic()))
                )
                stop.wait(wait)
        finally:
            self.events.close()


def _log_down(exc: KVStateError) -> None:
    log.warning("monitor sweep failed: %s; retrying every sweep", exc)


def _log_back(seconds: float, failed: int) -> None:
    log.warning("Redis is back after %.1f s (%d failed sweep(s))", seconds, failed)


__all__ = ["NOTIFY_SETTING", "PROBE_WAIT", "Monitor", "Seen"]
