"""KVManager: one engine rank. It registers the rank (``Lease``: one owner per engine
name), makes the rank's senders and receivers, answers a scheduler step's calls for
many rooms at once (``StepCalls``, in ``steps``), and watches the peers its rooms are
bound to (``PeerWatch``); its clears go at once or with its next batch (``Clears``).
It holds its participants through the ``Step`` protocol only.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from collections.abc import Iterable, Mapping
from typing import TypeVar

from kvstate.codec import is_int
from kvstate.defaults import BOOTSTRAP_TIMEOUT, LEASE, WAITING_TIMEOUT
from kvstate.errors import (
    EngineNameTakenError,
    ForkedManagerError,
    InvalidValueError,
    ManagerClosedError,
)
from kvstate.gpu import gpu_facts
from kvstate.keys import Side, check_name, check_room
from kvstate.poll import KVPoll
from kvstate.registry import Claim, EngineInfo, Registry
from kvstate.roles.behind import Behind
from kvstate.roles.clears import Clears
from kvstate.roles.contract import Bound, LookupKey, Step
from kvstate.roles.lease import Lease
from kvstate.roles.notices import Notices
from kvstate.roles.peers import PeerWatch
from kvstate.roles.predecessor import clear_predecessor
from kvstate.roles.receiver import KVReceiver
from kvstate.roles.sender import KVSender
from kvstate.roles.steps import StepCalls
from kvstate.roles.table import Participants
from kvstate.stats import TransferRecorder
from kvstate.store import Store, one_call
from kvstate.tp import Route
from transports.base import Transport

log = logging.getLogger(__name__)
_P = TypeVar("_P", bound=Step)
_R = TypeVar("_R")
ROLES: dict[str, Side] = {"prefill": "tx", "decode": "rx"}

# Managers of this process, so that a fork can mark them unusable in the child: the
# child has no heartbeat thread and shares the parent's name and incarnation.
_MANAGERS: weakref.WeakSet[KVManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mgr in list(_MANAGERS):
        mgr.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_managers() -> list[KVManager]:
    """The KVManagers of this process not closed yet (a test's leak check)."""
    return [m for m in list(_MANAGERS) if not m.closed and not m.forked]


class KVManager(StepCalls):
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
        self.forked = False  # this copy lives in a forked child: it may not act
        self.closed = False
        self._parts = Participants(self.engine)
        self.notices = Notices(self._parts, None, store.options.notice_sweep)
        self._peers = PeerWatch(self.engine)
        self.clears = Clears(store, self.engine, self.prefill_engines, self.forget)
        self.behind = Behind(self.engine)  # the calls made wait=False
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
        # the registration, renewed by a thread on a store of its own
        self.heartbeat = Lease(
            store,
            self.info,
            lease,
            self.heartbeat_interval,
            on_beat=self._beat,
            on_taken=self._lease_taken,
        )
        # change notices (issue 33 target 3), subscribed once registered (a Redis out of
        # reach failed the registration first), within one call's time: the first
        # step's drain answers "everything" until the subscription is confirmed
        if store.options.notices:
            self.notices.feed = store.changes(self.engine)
            with store.bounded():
                self.notices.feed.start()
        # Opt-in: the counters' key outlives the engine (24 h) so the monitor can read
        # its final totals, which tests and users who count keys left would not expect.
        self.recorder = (
            TransferRecorder(self.heartbeat.store, self.engine)
            if transfer_stats and transport is not None
            else None
        )
        _MANAGERS.add(self)

    def __repr__(self) -> str:
        return f"<KVManager {self.role} {self.engine} {self.incarnation} {self.store!r}>"

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live_rooms(self) -> list[int]:
        """The rooms of this rank's participants not cleared yet."""
        return self._parts.rooms()

    def check_usable(self, new: bool = False) -> None:
        """Refuse use of a closed manager or from a forked child, and (``new``) new
        participants of a manager whose engine name another process holds now."""
        if self.closed and not self.forked:
            raise ManagerClosedError(
                f"KVManager {self.engine} was closed (its lease dropped, its heartbeat "
                "stopped): its senders and receivers cannot be used; make a new KVManager "
                "to go on"
            )
        if self.forked:
            raise ForkedManagerError(
                f"KVManager {self.engine} was made in another process (this one is a fork "
                "of it): a fork shares its engine name and lease without a heartbeat. Make "
                "a new kvstate.connect() and KVManager, with its own engine name, in the "
                "child"
            )
        self.behind.settle()  # a call running behind the step ends first
        taken = self.heartbeat.taken
        if new and taken is not None:  # our lease lapsed (we stalled) and was taken
            raise EngineNameTakenError(
                self.engine, taken.holder, taken.host, taken.pid, self.store.namespace
            )

    # -- participants --------------------------------------------------------------
    def sender(
        self,
        room: object,
        required_receivers: int | None = 1,
        trace_context: str | None = None,
    ) -> KVSender:
        """A sender waiting for ``required_receivers`` receivers to publish their pages;
        None: as many as they declare (``receivers_per_sender`` on their side: a decode
        of another tensor-parallel size, ``kvstate.tp``). ``trace_context``: the serving
        request's W3C traceparent (checked by ``kvstate.trace.traceparent``), kept in a
        traced room's trace (no round trip added) so its OpenTelemetry spans link to the
        request's trace."""
        return self._keep(KVSender(self, room, required_receivers, trace_context))

    def receiver(
        self,
        room: object,
        bootstrap_addr: str,
        required_senders: int | None = None,
        senders: Iterable[str] | Mapping[str, Route] | None = None,
        receivers_per_sender: int = 0,
        trace_context: str | None = None,
    ) -> KVReceiver:
        """A receiver bound to the prefill engines at ``bootstrap_addr`` as they register
        (or to those named in ``senders``). It needs an ack from ``required_senders`` of
        them; by default from as many as the prefill group declares (its ``ranks``), or
        as are registered there at its first binding, whichever is more. Never raises for
        a prefill that is not up yet (it stays Bootstrapping); touches no Redis here.

        Tensor parallelism of another size on the prefill side: ``senders`` maps each
        sender to its ``Route`` (the heads it writes here, or a dummy), and
        ``receivers_per_sender`` declares how many receivers each of them waits for
        (``kvstate.tp.routes`` and ``receivers_per_sender`` compute both)."""
        check_room(room)
        names = None if senders is None else [check_name(s, "sender engine") for s in senders]
        routes = dict(senders) if isinstance(senders, Mapping) else None
        return self._keep(
            KVReceiver(
                self,
                room,
                bootstrap_addr,
                names,
                required_senders,
                routes,
                receivers_per_sender,
                trace_context,
            )
        )

    def _keep(self, part: _P) -> _P:
        """A new participant: held for the batches, polled at the next step."""
        self.notices.ask(part.room)
        return self._parts.keep(part)

    def clear_predecessor(self) -> list[int]:
        """Fail and clear the rooms a previous process under this engine name left
        (killed before it cleared them), so that their other side need not wait for
        their timeouts; returns those rooms. Call it right after making the manager,
        before it makes any participant (``kvstate.roles.predecessor``)."""
        self.check_usable()
        return clear_predecessor(self.store, self.side, self.engine)

    def lease_lapsed(self) -> str:
        """Why this engine may have lost its lease ('' while it surely holds it); its
        senders must not finish then (design rule 3)."""
        return self.heartbeat.lapsed()

    def forget(self, part: Step) -> None:
        """A participant cleared: the batches and the heartbeat no longer see it."""
        self._parts.forget(part)
        self.notices.forget(part.room)

    def prefill_engines(self, key: LookupKey) -> list[EngineInfo]:
        """The live prefill engines at an address (or among named ones), read fresh for
        each call or batch: a remembered answer would bind a receiver to a group that
        has grown since."""
        self.check_usable()
        addr, names = key
        if names:
            infos = self.registry.get_many(list(names)).values()
            return [i for i in infos if i is not None and i.role == "prefill"]
        return self.registry.listed_at(addr, "prefill")

    def watch(self, bound: Bound) -> None:
        """A receiver bound these prefill engines: the heartbeat fails the rooms bound to
        any of them that dies."""
        self._peers.watch(bound)

    def peer(self, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout), cached per incarnation."""
        self.check_usable()
        return self._peers.registration(self.registry, engine, incarnation)

    # -- peers and leases ------------------------------------------------------------
    @one_call
    def fail_peer(
        self, bootstrap_addr: str, reason: str, engine: str = "", incarnation: str = ""
    ) -> int:
        """Fail every non-terminal receiver bound to a peer (and so its room: the failure
        mark); returns how many failed."""
        self.check_usable()
        addr = check_name(bootstrap_addr, "bootstrap_addr")
        return self._peers.fail_peer(
            self.store, self._parts.all(), addr, reason, engine, incarnation
        )

    def _beat(self, registry: Registry) -> None:
        """After each renewal: the peer watch, on the lease's own store."""
        self._peers.check(registry, self._parts.all())

    def _lease_taken(self, claim: Claim, store: Store) -> None:
        """Another process registered this name after our lease lapsed (we stalled):
        stop renewing, never displace it, and fail our own rooms with the reason."""
        reason = (
            f"engine {self.engine}'s lease lapsed and another process took the name (host "
            f"{claim.host}, pid {claim.pid}, incarnation {claim.holder}); this one "
            f"({self.info.host}, pid {self.info.pid}) stopped renewing it"
        )
        log.error("%s", reason)
        mine = [p for p in self._parts.all() if p.create_sent and not p.cleared]
        store.execute(
            [store.update(p.room, p.side, self.engine, KVPoll.Failed, reason) for p in mine],
            partial=True,
        )

    def close(self) -> None:
        """Stop the heartbeat and drop the lease (if it is still ours). In a forked child
        only marks this copy closed: the lease is the parent's."""
        if self.closed:
            return
        if not self.forked:  # a fork has no thread behind: its parent's call ran there
            self.behind.close()
        if self.clears.due and not self.forked:  # best effort: else their keys expire
            self.clears.flush()
        self.closed = True
        if self.forked:
            return
        self.notices.close()
        self.heartbeat.close(self.recorder.close if self.recorder is not None else lambda: None)


__all__ = ["ROLES", "KVManager", "open_managers"]
