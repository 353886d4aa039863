"""The rank's peers: their registrations (read once per incarnation, for a sender's
writes), and the watch: a rank's heartbeat fails the rooms bound to a peer engine that died
(its lease lapsed, or it restarted under a new incarnation), both ways: on the decode
side the receivers bound to a dead prefill engine, on the prefill side the senders
writing to a dead decode engine (design.md, API: "Its heartbeat watches the peers")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from kvstate.errors import CorruptStateError, KVStateError
from kvstate.poll import KVPoll
from kvstate.registry import EngineInfo, Registry
from kvstate.roles.contract import Bound, Step
from kvstate.store import Store
from transports.base import TransportError

log = logging.getLogger(__name__)


class PeerWatch:
    """The peers one rank's rooms are bound to, and the verdicts on them."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._watched: set[tuple[str, str, str]] = set()  # (peer engine, addr, incarnation)
        self._misses: dict[tuple[str, str], int] = {}  # (engine, incarnation) -> checks missing
        self._registrations: dict[tuple[str, str], EngineInfo] = {}

    def registration(self, registry: Registry, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout) for a sender's writes, read once
        per incarnation; TransportError when that incarnation is gone (the room fails)."""
        with self._lock:
            info = self._registrations.get((engine, incarnation))
        if info is None:
            info = registry.get(engine)
            if info is None or (incarnation and info.incarnation != incarnation):
                raise TransportError(f"receiver {engine} (incarnation {incarnation}) is gone")
            with self._lock:
                self._registrations[(engine, incarnation)] = info
        return info

    def watch(self, bound: Bound) -> None:
        """A receiver bound these prefill engines at ``bound.addr``: watch them."""
        with self._lock:
            self._watched.update((e, bound.addr, inc) for e, inc in bound.peers.items())

    def fail_peer(
        self,
        store: Store,
        parts: Sequence[Step],
        addr: str,
        reason: str,
        engine: str = "",
        incarnation: str = "",
    ) -> int:
        """Fail every non-terminal receiver bound to a peer at ``addr`` (that engine and
        incarnation, or any if ''), and so its room, through the address tracker and
        by key among ``parts`` (a receiver that outlived its tracker entry, its room
        TTL shorter than its timeouts, is still reached); returns how many failed."""
        n = store.fail_bound(addr, engine, incarnation, reason)
        calls = [c for p in parts for c in p.fail_calls(addr, engine, incarnation, reason)]
        return n + count_failed(store.execute(calls, partial=True))

    def check(self, registry: Registry, parts: Sequence[Step]) -> None:
        """Fan-out both ways (one heartbeat): receivers bound to a dead prefill,
        senders writing to a dead decode."""
        store = registry.store
        with self._lock:
            watched = set(self._watched)
        writes_to = self._writes_to(parts)
        pairs = {(e, i) for e, _, i in watched} | set(writes_to)
        if not pairs:
            return
        now = registry.incarnations(sorted({e for e, _ in pairs}))
        dead = {(e, i): why for e, i in pairs if (why := self._verdict(e, i, now[e]))}
        for engine, addr, inc in watched:
            if (engine, inc) in dead:
                why = f"peer {engine} at {addr} {dead[engine, inc]}"
                n = self.fail_peer(store, parts, addr, why, engine, inc)
                log.warning("%s: failed %d room(s)", why, n)
                with self._lock:
                    self._watched.discard((engine, addr, inc))
        calls, failed = [], []
        for (engine, inc), snds in writes_to.items():
            if (engine, inc) in dead:
                reason = f"receiver {engine} {dead[engine, inc]}"
                calls += [
                    store.update(s.room, s.side, self.engine, KVPoll.Failed, reason) for s in snds
                ]
                failed += snds
                log.warning("%s: failed %d sender(s)", reason, len(snds))
        count_failed(store.execute(calls, partial=True))  # a corrupt room fails alone
        for snd in failed:
            snd.peer_died()  # once is enough: its next poll reads Failed

    def _writes_to(self, parts: Sequence[Step]) -> dict[tuple[str, str], list[Step]]:
        """The live participants (senders) that write to each (receiver engine,
        incarnation)."""
        out: dict[tuple[str, str], list[Step]] = {}
        for p in parts:
            try:
                incarnations = p.writes_to()
            except CorruptStateError as exc:  # that room's send() will say so; watch the rest
                log.warning("heartbeat of %s: %s", self.engine, exc)
                continue
            for engine, inc in incarnations.items():
                out.setdefault((engine, inc), []).append(p)
        return out

    def _verdict(self, engine: str, inc: str, now: str | None) -> str:
        """Why a peer bound at ``inc`` is dead, or '' while it is not (yet)."""
        if now == inc:
            self._misses.pop((engine, inc), None)
            return ""
        if now is None:
            # A lease must be missing on two checks in a row (still well within two
            # lease periods): right after a Redis restart, peers have not yet
            # registered again, and their rooms are not theirs to lose.
            misses = self._misses[(engine, inc)] = self._misses.get((engine, inc), 0) + 1
            if misses < 2:
                return ""
            why = f"lost its lease (incarnation {inc})"
        else:
            why = f"restarted (incarnation {inc} -> {now})"
        self._misses.pop((engine, inc), None)
        return why


def count_failed(replies: Iterable[object]) -> int:
    """How many of a fan-out's scripts failed a participant (1 each); a room whose state
    is corrupt (its error in place) counts none and stops no other."""
    n = 0
    for reply in replies:
        if isinstance(reply, KVStateError):
            log.warning("fan-out skipped a room: %s", reply)
        elif isinstance(reply, int):
            n += reply
    return n


__all__ = ["PeerWatch", "count_failed"]
