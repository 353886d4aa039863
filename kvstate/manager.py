"""KVManager: one engine rank. It registers the rank (one owner per engine name),
keeps its lease, makes the rank's senders and receivers (kvstate.roles), answers a
scheduler step's calls for many rooms at once, and watches the peers its rooms are
bound to.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from kvstate.codec import is_int
from kvstate.defaults import BOOTSTRAP_TIMEOUT, LEASE, WAITING_TIMEOUT
from kvstate.errors import (
    CorruptStateError,
    EngineNameTakenError,
    ForkedManagerError,
    InvalidValueError,
    KVStateError,
    ManagerClosedError,
    NotReadyError,
)
from kvstate.gpu import gpu_facts
from kvstate.keys import Side, check_name, check_room
from kvstate.poll import KVPoll, PollResults
from kvstate.rank import Lookups, Step
from kvstate.registry import Claim, EngineInfo, Registry
from kvstate.roles import KVReceiver, KVSender, Participant
from kvstate.stats import TransferRecorder
from kvstate.store import Call, Store, one_call
from transports.base import Transport, TransportError

log = logging.getLogger(__name__)
_P = TypeVar("_P", bound=Participant)
ROLES: dict[str, Side] = {"prefill": "tx", "decode": "rx"}
# what begin_many / finish_many may answer for a room; any other status is not ready
_READY = {
    "begin": (KVPoll.Transferring, KVPoll.Success, KVPoll.Failed),
    "finish": (KVPoll.Success, KVPoll.Failed),
}

# Managers of this process, so that a fork can mark them unusable in the child: the
# child has no heartbeat thread and shares the parent's name and incarnation.
_MANAGERS: weakref.WeakSet[KVManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mgr in list(_MANAGERS):
        mgr._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class KVManager:
    """One engine rank: registers itself (one owner per engine name), keeps its lease on
    a connection of its own, makes participants, and watches its peers: the decode side
    the prefill engines its receivers are bound to, the prefill side the receivers its
    live senders write to. A peer whose lease lapsed or that restarted fails the rooms
    bound to it, with a reason naming it."""

    def __init__(
        self,
        store: Store,
        role: str,
        engine: str,
        bootstrap_addr: str | None = None,
        transport: Transport | None = None,
        *,
        lease: float = LEASE,
        heartbeat_interval: float | None = None,
        bootstrap_timeout: float = BOOTSTRAP_TIMEOUT,
        waiting_timeout: float = WAITING_TIMEOUT,
        transfer_timeout: float = 60.0,
        ranks: int = 1,
        transfer_stats: bool = False,
    ) -> None:
        if store.closed:  # before anything is made or registered on it
            raise store.closed_error()
        if role not in ROLES:
            raise InvalidValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        if lease <= 0 or bootstrap_timeout < 0 or waiting_timeout < 0 or transfer_timeout <= 0:
            raise InvalidValueError(
                "lease and transfer_timeout must be > 0, timeouts >= 0 (0 = none)"
            )
        if not is_int(ranks) or ranks < 1:
            raise InvalidValueError(f"ranks must be an int >= 1, got {ranks!r}")
        self.store = store
        self.role = role
        self.side: Side = ROLES[role]
        self.engine = check_name(engine, "engine")
        self.bootstrap_addr = check_name(bootstrap_addr or engine, "bootstrap_addr")
        self.transport = transport
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval or lease / 3
        self.bootstrap_timeout = bootstrap_timeout
        self.waiting_timeout = waiting_timeout
        self.transfer_timeout = transfer_timeout
        self.incarnation = uuid.uuid4().hex[:16]
        self.registry = Registry(store)
        self._lock = threading.Lock()
        self._live: dict[int, Participant] = {}
        self._watched: set[tuple[str, str, str]] = set()  # (peer engine, addr, incarnation)
        self._misses: dict[tuple[str, str], int] = {}  # (engine, incarnation) -> checks missing
        self._peers: dict[tuple[str, str], EngineInfo] = {}
        self._forked = False
        self._closed = False
        self._taken: Claim | None = None  # who holds our name since our lease lapsed
        # monotonic time until which the lease is surely ours: the start of the last
        # register/renew Redis confirmed, plus the lease (a finish after it fails)
        self._lease_until = 0.0
        self.info = EngineInfo(
            engine=self.engine,
            role=role,
            addr=self.bootstrap_addr,
            incarnation=self.incarnation,
            endpoint=transport.endpoint() if transport else b"",
            layout=transport.layout() if transport else {},
            gpus=gpu_facts(),
            ranks=ranks,
        )
        # The heartbeat's own client and pool: a workload holding every connection of
        # the shared pool (or a server at maxclients) cannot make the lease lapse.
        with store.bounded():  # making it (a Cluster's slot map) and registering: one call
            self._hb_store = store.dedicated()
            self._hb_registry = Registry(self._hb_store)
            try:
                started = time.monotonic()
                self._hb_registry.register(self.info, lease)
                self._lease_until = started + lease
            except BaseException:
                self._hb_store.close()
                raise
        # Opt-in: the counters' key outlives the engine (24 h) so the monitor can read
        # its final totals, which tests and users who count keys left would not expect.
        self.recorder = (
            TransferRecorder(self._hb_store, self.engine)
            if transfer_stats and transport is not None
            else None
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"kvstate-{engine}", daemon=True
        )
        self._thread.start()
        _MANAGERS.add(self)

    def __repr__(self) -> str:
        return f"<KVManager {self.role} {self.engine} {self.incarnation} {self.store!r}>"

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_usable(self, new: bool = False) -> None:
        """Refuse use of a closed manager or from a forked child, and (``new``) new
        participants of a manager whose engine name another process holds now."""
        if self._closed and not self._forked:
            raise ManagerClosedError(
                f"KVManager {self.engine} was closed (its lease dropped, its heartbeat "
                "stopped): its senders and receivers cannot be used; make a new KVManager "
                "to go on"
            )
        if self._forked:
            raise ForkedManagerError(
                f"KVManager {self.engine} was made in another process (this one is a fork "
                "of it): a fork shares its engine name and lease without a heartbeat. Make "
                "a new kvstate.connect() and KVManager, with its own engine name, in the "
                "child"
            )
        taken = self._taken
        if new and taken is not None:  # our lease lapsed (we stalled) and was taken
            raise EngineNameTakenError(
                self.engine, taken.holder, taken.host, taken.pid, self.store.namespace
            )

    # -- participants --------------------------------------------------------------
    def sender(self, room: object, required_receivers: int = 1) -> KVSender:
        return self._keep(KVSender(self, room, required_receivers))

    def receiver(
        self,
        room: object,
        bootstrap_addr: str,
        required_senders: int | None = None,
        senders: Iterable[str] | None = None,
    ) -> KVReceiver:
        """A receiver bound to the prefill engines at ``bootstrap_addr`` as they register
        (or to those named in ``senders``). It needs an ack from ``required_senders`` of
        them; by default from as many as the prefill group declares (its ``ranks``), or
        as are registered there at its first binding, whichever is more. Never raises for
        a prefill that is not up yet (it stays Bootstrapping); touches no Redis here."""
        check_room(room)
        names = None if senders is None else [check_name(s, "sender engine") for s in senders]
        return self._keep(KVReceiver(self, room, bootstrap_addr, names, required_senders))

    def lease_lapsed(self) -> str:
        """Why this engine may have lost its lease ('' while it surely holds it): no
        renewal confirmed within a lease (the process was stopped or cut off from
        Redis), or another process took the name. Its peers may have failed its rooms
        meanwhile, so it must not write Success (design rule 3)."""
        if self._taken is not None:
            return f"engine {self.engine}'s lease was taken by another process"
        started = time.monotonic()
        late = started - self._lease_until
        if late <= 0:
            return ""
        # No renewal confirmed within a lease (a starved heartbeat, or a stop): ask Redis
        # whether the registration outlived it, one round trip in this rare case only.
        try:
            claim = self._hb_registry.renew(self.info, self.lease)
        except KVStateError as exc:
            claim = None
            log.warning("lease check of %s: %s", self.engine, exc)
        if claim is not None and claim.answer == "renewed":  # it never lapsed
            self._lease_until = started + self.lease
            return ""
        return (
            f"engine {self.engine} lost its lease ({self.lease:g} s): no renewal confirmed "
            f"for {late + self.lease:.1f} s (stopped, or cut off from Redis), and Redis "
            f"answered {claim.answer if claim else 'nothing'}; its peers may have failed "
            "the room, so it cannot succeed"
        )

    def _keep(self, p: _P) -> _P:
        with self._lock:
            self._live[p.room] = p
        return p

    def forget(self, part: Step) -> None:
        """A participant cleared: the batches and the heartbeat no longer see it."""
        with self._lock:
            if self._live.get(part.room) is part:
                del self._live[part.room]

    def prefill_engines(
        self, addr: str, names: list[str] | None, lookups: Lookups | None = None
    ) -> list[EngineInfo]:
        """The live prefill engines at ``addr`` (or among ``names``), read fresh for
        each call or batch (``lookups``): a remembered answer would bind a receiver to a
        group that has grown since."""
        self.check_usable()
        memo = (addr, tuple(names) if names else None)
        if lookups is not None and memo in lookups:
            return lookups[memo]
        if names:
            found = [
                i
                for i in self.registry.get_many(names).values()
                if i is not None and i.role == "prefill"
            ]
        else:
            found = self.registry.listed_at(addr, "prefill")
        if lookups is not None:
            lookups[memo] = found
        return found

    def watch(self, addr: str, bound: dict[str, str]) -> None:
        """A receiver bound these prefill engines (engine -> incarnation) at ``addr``:
        the heartbeat fails the rooms bound to any of them that dies."""
        with self._lock:
            self._watched.update((engine, addr, inc) for engine, inc in bound.items())

    def peer(self, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout), cached per incarnation."""
        self.check_usable()
        with self._lock:
            info = self._peers.get((engine, incarnation))
        if info is None:
            info = self.registry.get(engine)
            if info is None or (incarnation and info.incarnation != incarnation):
                raise TransportError(f"receiver {engine} (incarnation {incarnation}) is gone")
            with self._lock:
                self._peers[(engine, incarnation)] = info
        return info

    def poll_many(self, rooms: Iterable[object]) -> PollResults:
        """Poll many rooms of this engine in one round trip per Redis node.

        Returns a ``PollResults``: a dict room -> KVPoll. On a Cluster, the rooms on a
        node that cannot be reached within ``Options.call_timeout`` are left out of it
        and listed in ``.errors`` (room -> StateConnectionError) while the others are
        answered; their participants keep their last status. Raises
        StateConnectionError when no node answered.
        """
        return self._many(rooms, "poll")

    def begin_many(self, rooms: Iterable[object]) -> PollResults:
        """``begin_transfer()`` of many senders of this (prefill) manager in one round
        trip per Redis node: a scheduler step's worth. Each room is Transferring, or
        Failed (write nothing to it) as ``begin_transfer`` says; a sender that has seen
        no receiver's infos yet is polled instead (it cannot begin before they
        published). Answers and partial results (``.errors``) as ``poll_many``; a room
        with no live sender of this manager is refused (KVStateError) before anything
        is sent."""
        return self._many(rooms, "begin")

    def finish_many(self, rooms: Iterable[object]) -> PollResults:
        """``finish_transfer()`` of many senders of this manager in one round trip per
        Redis node: each becomes Success and acks its receivers. As ``begin_many``."""
        return self._many(rooms, "finish")

    def init_many(self, pages: Mapping[object, object]) -> PollResults:
        """``init(kv_indices)`` of many receivers of this (decode) manager, room ->
        page indices, in one round trip per Redis node: the pages of every request a
        step allocated, published at once. Each room's answer is what ``init`` returns;
        partial results (``.errors``) as ``poll_many``. Arguments are checked (and the
        transport told) before anything is sent; a room without a live receiver here is
        refused. For aux, state indices, prefix or dummy, call ``init`` itself."""
        self.check_usable()
        wanted = {check_room(room): indices for room, indices in pages.items()}

        def prepare(p: Participant) -> None:
            assert isinstance(p, KVReceiver)
            p.prepare(wanted[p.room], None, None, 0, False)

        return self._many(wanted, "init", prepare)

    def clear_many(self, rooms: Iterable[object]) -> dict[int, KVStateError]:
        """``clear()`` of this manager's participants of many rooms in one round trip
        per Redis node. Returns the rooms not cleared, each with its node's
        StateConnectionError (Cluster, node unreachable): they stay live here and can be
        cleared again; rooms without a live participant here are skipped (a clear is
        idempotent). Raises StateConnectionError when no node answered."""
        self.check_usable()
        todo: list[Participant] = []
        for room in rooms:
            r = check_room(room)
            with self._lock:
                p = self._live.get(r)
            if p is not None and not p.cleared:
                todo.append(p)
        sent = [p for p in todo if p.create_sent]
        errors = self.store.clear_many([p.clear_calls() for p in sent])
        failed = {p.room: e for p, e in zip(sent, errors, strict=True) if e is not None}
        for p in todo:
            if p.room not in failed:
                p.after_clear()
        return dict(failed)

    @one_call
    def _many(
        self,
        rooms: Iterable[object],
        op: str,
        prepare: Callable[[Participant], None] | None = None,
    ) -> PollResults:
        """One batch of ``op`` (poll, begin, finish, init) over many rooms: creates and
        bindings still due go first in the same batch (a Cluster's: one registry read
        per address first);
        ``prepare`` runs on each participant before its calls are made. A room the
        one-room call would refuse (NotReadyError: begin before its receivers
        published, finish before begin) or whose state is corrupt (CorruptStateError)
        is listed in ``.errors``, the other rooms answered."""
        self.check_usable()
        side = "rx" if op == "init" else "tx"
        if op != "poll" and self.side != side:
            raise KVStateError(
                f"{op}_many is for a {'decode' if side == 'rx' else 'prefill'} manager's "
                f"{'receivers' if side == 'rx' else 'senders'}; {self.engine} is {self.role}"
            )
        plan, calls = self._plan(rooms, op, prepare)
        try:
            replies = self.store.execute(calls, partial=True)
        except BaseException:
            for _, p, _ in plan:  # bindings in that batch did not run (or not whole)
                if p is not None:
                    p.step_lost()
            raise
        out = PollResults()
        for r, p, i in plan:
            st = replies[i]
            if isinstance(st, KVStateError):  # that room's node did not answer
                out.errors[r] = st
                if p is not None:
                    p.step_lost()
            elif p is not None:
                p.step_ran(st)
                if op in _READY and p.status not in _READY[op]:
                    out.errors[r] = _not_ready(r, op, p.status)
                else:
                    out[r] = p.status
            else:
                out[r] = st.status if st.status is not None else KVPoll.Failed
        return out

    def _plan(
        self,
        rooms: Iterable[object],
        op: str,
        prepare: Callable[[Participant], None] | None,
    ) -> tuple[list[tuple[int, Participant | None, int]], list[Call]]:
        """The calls of one batch, and per room (room, its live participant or None,
        the index of the reply that is its status). A room without a live participant
        is polled as a bare room (poll only; any other op refuses it)."""
        lapsed = self.lease_lapsed() if op == "finish" else ""  # once for the batch
        plan: list[tuple[int, Participant | None, int]] = []
        calls: list[Call] = []
        lookups: Lookups = {}  # receivers still binding: one registry read per address
        for room in rooms:
            r = check_room(room)
            with self._lock:
                p = self._live.get(r)
            if p is not None and p.cleared:
                p = None
            if p is None and op != "poll":
                raise KVStateError(
                    f"room {r}: {self.engine} has no live participant for it; {op}_many "
                    "takes the rooms of this manager's senders or receivers (not cleared)"
                )
            if p is not None:
                if prepare is not None:
                    prepare(p)
                more, at = p.step_calls(op, lookups, lapsed)
                plan.append((r, p, len(calls) + at))
                calls += more
            else:
                plan.append((r, p, len(calls)))
                calls.append(self.store.poll(r, self.side, self.engine))
        return plan, calls

    # -- peers and leases ------------------------------------------------------------
    @one_call
    def fail_peer(
        self, bootstrap_addr: str, reason: str, engine: str = "", incarnation: str = ""
    ) -> int:
        """Fail every non-terminal receiver bound to a peer (and so its room: the failure
        mark); returns how many failed."""
        self.check_usable()
        return self._fail_peer(
            self.store, check_name(bootstrap_addr, "bootstrap_addr"), reason, engine, incarnation
        )

    def _fail_peer(
        self, store: Store, addr: str, reason: str, engine: str, incarnation: str
    ) -> int:
        """Through the address tracker, and this manager's own receivers by key: a
        receiver that outlived its tracker entry (room TTL shorter than its timeouts)
        is still reached."""
        n = store.fail_bound(addr, engine, incarnation, reason)
        with self._lock:
            own = [
                p.key
                for p in self._live.values()
                if isinstance(p, KVReceiver)
                and p.bootstrap_addr == addr
                and p.create_sent
                and not p.cleared
            ]
        replies = store.execute(
            [store.fail_receiver(k, engine, incarnation, reason) for k in own], partial=True
        )
        return n + _count(replies)

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

    def _senders_by_receiver(self) -> dict[tuple[str, str], list[KVSender]]:
        """The live senders that write to each (receiver engine, incarnation)."""
        with self._lock:
            senders = [p for p in self._live.values() if isinstance(p, KVSender)]
        writes_to: dict[tuple[str, str], list[KVSender]] = {}
        for snd in senders:
            try:
                incarnations = snd.writes_to()
            except CorruptStateError as exc:  # that room's send() will say so; watch the rest
                log.warning("heartbeat of %s: %s", self.engine, exc)
                continue
            for engine, inc in incarnations.items():
                writes_to.setdefault((engine, inc), []).append(snd)
        return writes_to

    def _check_peers(self) -> None:
        """Fan-out both ways: receivers bound to a dead prefill (decode side), senders
        writing to a dead decode (prefill side)."""
        with self._lock:
            watched = set(self._watched)
        writes_to = self._senders_by_receiver()
        pairs = {(e, i) for e, _, i in watched} | set(writes_to)
        if not pairs:
            return
        now = self._hb_registry.incarnations(sorted({e for e, _ in pairs}))
        dead = {(e, i): why for e, i in pairs if (why := self._verdict(e, i, now[e]))}
        for engine, addr, inc in watched:
            if (engine, inc) in dead:
                why = f"peer {engine} at {addr} {dead[engine, inc]}"
                n = self._fail_peer(self._hb_store, addr, why, engine, inc)
                log.warning("%s: failed %d room(s)", why, n)
                with self._lock:
                    self._watched.discard((engine, addr, inc))
        calls, failed = [], []
        for (engine, inc), snds in writes_to.items():
            if (engine, inc) in dead:
                reason = f"receiver {engine} {dead[engine, inc]}"
                calls += [
                    self._hb_store.update(s.room, "tx", self.engine, KVPoll.Failed, reason)
                    for s in snds
                ]
                failed += snds
                log.warning("%s: failed %d sender(s)", reason, len(snds))
        _count(self._hb_store.execute(calls, partial=True))  # a corrupt room fails alone
        for snd in failed:
            snd.peer_died()  # once is enough: its next poll reads Failed

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                started = time.monotonic()
                claim = self._hb_registry.renew(self.info, self.lease)
                if claim.answer == "taken":
                    self._lease_taken(claim)
                    return
                self._lease_until = started + self.lease
                if claim.answer == "lapsed":
                    log.warning("lease of %s had lapsed; registered again", self.engine)
                self._check_peers()
            except KVStateError as exc:
                log.warning("heartbeat of %s: %s", self.engine, exc)
            except Exception as exc:  # the lease must outlive any surprise; never die
                log.warning(
                    "heartbeat of %s: unexpected %s: %s", self.engine, type(exc).__name__, exc
                )

    def _lease_taken(self, claim: Claim) -> None:
        """Another process registered this name after our lease lapsed (we stalled):
        stop renewing, never displace it, and fail our own rooms with the reason."""
        self._taken = claim
        reason = (
            f"engine {self.engine}'s lease lapsed and another process took the name (host "
            f"{claim.host}, pid {claim.pid}, incarnation {claim.holder}); this one "
            f"({self.info.host}, pid {self.info.pid}) stopped renewing it"
        )
        self._stop.set()
        log.error("%s", reason)
        with self._lock:
            mine = [p for p in self._live.values() if p.create_sent and not p.cleared]
        self._hb_store.execute(
            [
                self._hb_store.update(p.room, p.side, self.engine, KVPoll.Failed, reason)
                for p in mine
            ],
            partial=True,
        )

    def close(self) -> None:
        """Stop the heartbeat and drop the lease (if it is still ours). In a forked child
        only marks this copy closed: the lease is the parent's."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._forked:
            return
        try:
            with self._hb_store.bounded():  # the join and the drop share one call_timeout
                if self._thread is not threading.current_thread():
                    self._thread.join(timeout=5)
                if self.recorder is not None:
                    self.recorder.close()
                if self._taken is None:
                    self._hb_registry.drop(self.engine, self.incarnation, self.bootstrap_addr)
        except KVStateError as exc:
            log.warning("could not drop the registration of %s: %s", self.engine, exc)
        finally:
            self._hb_store.close()


def _not_ready(room: int, op: str, status: KVPoll) -> NotReadyError:
    """What a batch says of a room its one-room call would refuse (nothing written)."""
    return NotReadyError(
        f"room {room}: not {'begun' if op == 'begin' else 'finished'}, nothing "
        f"written (status {status.name}): "
        + (
            "wait for WaitingForInput (every receiver published), poll, then begin"
            if op == "begin"
            else "begin_many (or begin_transfer) first"
        )
    )


def _count(replies: Iterable[object]) -> int:
    """How many of a fan-out's scripts failed a participant (1 each); a room whose state
    is corrupt (its error in place) counts none and stops no other."""
    n = 0
    for reply in replies:
        if isinstance(reply, KVStateError):
            log.warning("fan-out skipped a room: %s", reply)
        elif isinstance(reply, int):
            n += reply
    return n


__all__ = ["KVManager"]
