"""KVManager, KVSender and KVReceiver: where room state and KV bytes meet.

A participant is written to Redis with its first operation (poll, init,
abort...), in the same round trip, so creating one costs nothing by itself and
a full lifecycle stays within 8 round trips. ``clear()`` lives once, in the
base class, for every transport.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from kvstate import schema
from kvstate.codec import MAX_INDEX, TransferInfo, as_indices, unpack
from kvstate.defaults import BOOTSTRAP_TIMEOUT, LEASE, WAITING_TIMEOUT
from kvstate.errors import (
    CorruptStateError,
    EngineNameTakenError,
    ForkedManagerError,
    InvalidArgumentError,
    InvalidIndicesError,
    KVStateError,
    KVTransferError,
)
from kvstate.gpu import gpu_facts
from kvstate.keys import Side, check_name, check_room
from kvstate.poll import KVPoll, PollResults
from kvstate.registry import Claim, EngineInfo, Registry
from kvstate.stats import TransferRecorder
from kvstate.store import Call, Status, Store
from transports.base import Target, Transport, TransportError

log = logging.getLogger(__name__)
_P = TypeVar("_P", bound="_Participant")
ROLES: dict[str, Side] = {"prefill": "tx", "decode": "rx"}
# (bootstrap addr, named senders or None) -> the prefill engines found there
_Lookups = dict[tuple[str, tuple[str, ...] | None], list[EngineInfo]]
STATE_LOST = (
    "state lost: the participant's keys are gone (expired, cleared elsewhere, or Redis restarted)"
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MIN_BULK_LIMIT = 1 << 20  # the smallest proto-max-bulk-len Redis accepts


def _reason(reason: object) -> str:
    """Reasons are text in Redis: None (SGLang passes it) reads as 'no reason given';
    anything else that is not text is refused before anything is sent."""
    if reason is None:
        return "no reason given"
    if not isinstance(reason, str):
        raise InvalidArgumentError(f"a failure reason must be text (str), got {reason!r}")
    return reason


# Managers of this process, so that a fork can mark them unusable in the child: the
# child has no heartbeat thread and shares the parent's name and incarnation.
_MANAGERS: weakref.WeakSet[KVManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for mgr in list(_MANAGERS):
        mgr._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Participant:
    """What senders and receivers share: lazy creation, status, abort, the one clear."""

    side: Side

    def __init__(self, mgr: KVManager, room: object, peers: int, fields: dict[str, Any]) -> None:
        mgr._check_usable(new=True)
        if mgr.side != self.side:
            raise KVStateError(f"a {mgr.role} manager cannot make a {type(self).__name__}")
        self.mgr = mgr
        self.store = mgr.store
        self.room = check_room(room)
        self.engine = mgr.engine
        self.key = self.store.keys.participant(self.room, self.side, self.engine)
        self._fields = {
            schema.ADDR: mgr.bootstrap_addr,
            schema.PEERS: peers,
            schema.BOOTSTRAP_TIMEOUT_MS: int(mgr.bootstrap_timeout * 1000),
            schema.WAITING_TIMEOUT_MS: int(mgr.waiting_timeout * 1000),
            **fields,
        }
        self._created = False
        self._create_sent = False  # a create went out; it may have run even if the call failed
        self._cleared = False
        self._status = KVPoll.Bootstrapping
        self._reason = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.room} engine={self.engine} {self._status.name}>"

    # -- plumbing -------------------------------------------------------------
    def _create_calls(self, lookups: _Lookups | None = None) -> list[Call]:
        """Calls that go ahead of this participant's next operation, in its batch: the
        create (the first time) and, for a receiver, any binding still to make."""
        self.mgr._check_usable()
        if self._created:
            return []
        self._create_sent = True
        return [self.store.create(self.room, self.side, self.engine, self._fields)]

    def _poll_call(self) -> Call:
        return self.store.poll(self.room, self.side, self.engine)

    def _batch(self, call: Call, lookups: _Lookups | None = None) -> tuple[list[Call], int]:
        """The calls of one operation (the create and bindings still due first) and the
        index of the one whose reply is the participant's status. A first poll is the
        create alone: create.lua answers it (with a sender's infos), one script less."""
        first = not self._create_sent
        calls = self._create_calls(lookups)
        if not (first and calls and call.script == "poll"):
            calls.append(call)
        at = max(i for i, c in enumerate(calls) if c.parse == Status.parse)
        return calls, at

    def _run(self, call: Call) -> Status:
        """Run one operation, creating the participant first if this is its first."""
        if self._cleared:
            return Status(self._status, self._reason)
        calls, at = self._batch(call)
        replies = self.store.execute(calls)
        self._created = True
        return self._absorb(replies[at])

    def _absorb(self, st: Status) -> Status:
        if st.status is None:
            self._status, self._reason = KVPoll.Failed, STATE_LOST
        else:
            self._status, self._reason = st.status, st.reason
        return st

    # -- public -----------------------------------------------------------------
    @property
    def status(self) -> KVPoll:
        """The status seen by the last call (no round trip)."""
        return self._status

    def poll(self) -> KVPoll:
        self._run(self._poll_call())
        return self._status

    def fail(self, reason: str | None = None) -> KVPoll:
        """Record a failure of this participant only (Failed is sticky)."""
        self._run(
            self.store.update(self.room, self.side, self.engine, KVPoll.Failed, _reason(reason))
        )
        return self._status

    def abort(self, reason: str | None = "aborted") -> None:
        """Fail every participant of the room, the other side included."""
        if self._cleared:
            return
        self.store.execute(self._create_calls())
        self._created = True
        self.store.abort(self.room, f"{_reason(reason)} (by {self.side}:{self.engine})")
        self.poll()

    def failure_exception(self) -> KVTransferError:
        """The failure as an exception carrying the recorded reason; clears the participant."""
        if not self._cleared and self._created:
            self.poll()
        reason = self._reason or f"room {self.room} has status {self._status.name}"
        self.clear()
        return KVTransferError(self.room, reason)

    def clear(self) -> None:
        """Delete everything this participant created. Idempotent; never raises for
        state already gone."""
        if self._cleared:
            return
        self.mgr._check_usable()
        if self._create_sent:
            self.store.clear(self.room, self.side, self.engine, **self._clear_args())
        self._cleared = True
        self._release()
        self.mgr._forget(self)

    def _clear_args(self) -> dict[str, Any]:
        return {}

    def _release(self) -> None:
        if self.mgr.transport is not None:
            self.mgr.transport.release(self.room)


class KVSender(_Participant):
    """The prefill side of a room."""

    side: Side = "tx"

    def __init__(self, mgr: KVManager, room: object, required_receivers: int = 1) -> None:
        if not _is_int(required_receivers) or required_receivers < 1:
            raise ValueError(f"required_receivers must be an int >= 1, got {required_receivers!r}")
        super().__init__(mgr, room, required_receivers, {})
        self._infos: dict[str, bytes] = {}
        self._infos_version = -1  # poll.lua returns the infos only when this is stale
        self._decoded: dict[str, TransferInfo] | None = None
        self._incarnations: tuple[dict[str, bytes], dict[str, str]] | None = None
        self._num_pages: int | None = None
        self._sent = 0
        self._peer_failed = False  # the heartbeat failed it: a receiver's engine died

    def _poll_call(self) -> Call:
        return self.store.poll(
            self.room, "tx", self.engine, with_infos=True, infos_version=self._infos_version
        )

    def _absorb(self, st: Status) -> Status:
        if st.version >= 0:
            self._infos_version = st.version
            if st.infos != self._infos:
                self._infos, self._decoded = st.infos, None
        return super()._absorb(st)

    def _receiver_incarnations(self) -> dict[str, str]:
        """Receiver engine -> its incarnation, from the infos (for the heartbeat's
        fan-out; reads only the incarnation, cached per infos)."""
        infos = self._infos
        cached = self._incarnations
        if cached is not None and cached[0] is infos:
            return cached[1]
        key = self.store.keys.xfer(self.room, self.engine)
        out = {}
        for receiver, raw in infos.items():
            inc = unpack(raw, key, receiver).get("inc")
            if not isinstance(inc, str):
                raise CorruptStateError(key, receiver, f"incarnation {inc!r} is not text")
            if inc:
                out[receiver] = inc
        self._incarnations = (infos, out)
        return out

    def transfer_infos(self) -> dict[str, TransferInfo]:
        """What each receiver published, decoded strictly (as of the last poll)."""
        if not self._infos and not self._cleared:
            self.poll()
        if self._decoded is None:
            key = self.store.keys.xfer(self.room, self.engine)
            self._decoded = {r: TransferInfo.decode(r, raw, key) for r, raw in self._infos.items()}
        return self._decoded

    @property
    def prefix_len(self) -> int:
        """Tokens the receivers already have cached (the smallest of theirs)."""
        infos = self.transfer_infos()
        return min((i.prefix_len for i in infos.values()), default=0)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Announce how many pages ``send()`` will move (checked there). ``aux_index`` is
        accepted for SGLang's signature; aux data is not moved by kvstate's transport."""
        if not _is_int(num_kv_indices) or num_kv_indices < 0:
            raise InvalidIndicesError(f"num_kv_indices must be an int >= 0, got {num_kv_indices!r}")
        self._num_pages = num_kv_indices

    def _step_call(self, op: str) -> Call:
        """begin or finish for a batch (KVManager.begin_many / finish_many), with the
        receivers of the last poll; a poll while none has published yet."""
        if not self._infos:
            return self._poll_call()
        receivers = list(self._infos)
        if op == "begin":
            return self.store.begin(self.room, self.engine, receivers)
        return self.store.finish(self.room, self.engine, receivers)

    def _receivers(self) -> list[str]:
        """The receivers that published to this sender (polling once if none has yet):
        their names only, without decoding the infos' page indices (send() does)."""
        if not self._infos and not self._cleared:
            self.poll()
        return list(self._infos)

    def begin_transfer(self) -> KVPoll:
        """-> Transferring, for callers that move the bytes themselves; Failed instead
        (write nothing then) if a receiver failed or vanished meanwhile, or its engine
        lost its lease or restarted (the heartbeat failed this sender)."""
        self._run(self.store.begin(self.room, self.engine, self._receivers()))
        return self._status

    def finish_transfer(self) -> KVPoll:
        """-> Success; acks every receiver, which see Success on their next poll."""
        self._run(self.store.finish(self.room, self.engine, self._receivers()))
        return self._status

    def send(self, kv_indices: object, last: bool = True) -> KVPoll:
        """Move these source pages to every receiver (the next slice of each receiver's
        destination pages), then record the state transition. Any transport or registry
        failure on the way aborts the room with the reason (returns Failed); a Redis
        error is raised as StateConnectionError after a best-effort abort."""
        src = as_indices(kv_indices)
        transport = self.mgr.transport
        if transport is None:
            raise KVStateError(
                f"room {self.room}: send() needs a transport, and this KVManager has none; "
                "move the bytes yourself between begin_transfer() and finish_transfer() "
                "(both record the state), or pass transport= to KVManager"
            )
        infos = self.transfer_infos()
        if self._status in (KVPoll.Failed, KVPoll.Success):
            return self._status
        if self._status < KVPoll.WaitingForInput or not infos:
            raise KVStateError(
                f"room {self.room}: send() before every receiver published its pages "
                f"(status {self._status.name}); poll until WaitingForInput first"
            )
        total = self._sent + len(src)
        if self._num_pages is not None and total > self._num_pages:
            raise InvalidIndicesError(
                f"room {self.room}: sending {total} pages, more than init() announced "
                f"({self._num_pages})"
            )
        try:  # the one failure boundary: every way out below leaves the room decided
            targets = self._targets(infos, len(src))
            if self._status != KVPoll.Transferring and self.begin_transfer() != KVPoll.Transferring:
                return self._status
            if targets:
                moved, t0 = transport.stats.bytes_moved, time.perf_counter()
                transport.write(self.room, src, targets, self.mgr.transfer_timeout)
                if self.mgr.recorder is not None:
                    self.mgr.recorder.observe(
                        transport.stats.bytes_moved - moved, time.perf_counter() - t0
                    )
        except (TransportError, InvalidIndicesError) as exc:
            # the whole room: receivers learn it on their next poll instead of
            # waiting out their timeout for pages that will not come
            self.abort(f"transfer failed: {exc}")
            return self._status
        except KVStateError as exc:
            try:
                self.abort(f"transfer failed: {exc}")
            except KVStateError as again:  # Redis is what failed: the abort may fail too
                log.warning("room %s: could not abort after %s: %s", self.room, exc, again)
            raise
        self._sent = total
        if last:
            self.finish_transfer()
        return self._status

    def _targets(self, infos: dict[str, TransferInfo], n: int) -> list[Target]:
        targets = []
        for info in infos.values():
            if info.dummy:
                continue
            dst = info.kv_indices[self._sent : self._sent + n]
            if len(dst) != n:
                raise InvalidIndicesError(
                    f"room {self.room}: receiver {info.receiver} published {len(info.kv_indices)} "
                    f"pages, fewer than the {self._sent + n} being sent"
                )
            peer = self.mgr.peer(info.receiver, info.incarnation)
            targets.append(Target(peer.endpoint, peer.layout, dst))
        return targets


class KVReceiver(_Participant):
    """The decode side of a room. It binds to the prefill engines of its address as they
    register (until it has ``required_senders`` of them, or the engines named in
    ``senders``), each at its incarnation of that moment; the binding is part of its
    next operation, so a prefill that is not up yet leaves it Bootstrapping (and Failed
    after ``bootstrap_timeout``), never raises."""

    side: Side = "rx"

    def __init__(
        self,
        mgr: KVManager,
        room: object,
        bootstrap_addr: str,
        senders: list[str] | None,
        required_senders: int | None,
    ) -> None:
        if required_senders is not None and (not _is_int(required_senders) or required_senders < 1):
            raise ValueError(f"required_senders must be an int >= 1, got {required_senders!r}")
        if senders is not None and not senders:
            raise ValueError("senders, when given, must name at least one prefill engine")
        self.bootstrap_addr = check_name(bootstrap_addr, "bootstrap_addr")
        self._explicit = senders
        self._required = required_senders or (len(senders) if senders else 0)  # 0: not known
        self._bound: dict[str, str] = {}  # sender engine -> incarnation bound to
        self._pending: tuple[dict[str, str], int] | None = None  # a binding in flight
        self._payload = b""  # the transfer info, once init() made it
        super().__init__(mgr, room, self._required, {schema.PEER_ADDR: bootstrap_addr})

    @property
    def senders(self) -> list[str]:
        """The sender engines bound so far."""
        return sorted(self._bound)

    def _wanted(self) -> int:
        """How many senders to bind: the named ones, else the required count (0: ask)."""
        return len(self._explicit) if self._explicit else self._required

    def _create_calls(self, lookups: _Lookups | None = None) -> list[Call]:
        calls = super()._create_calls()
        if calls:
            calls.append(self.store.track(self.bootstrap_addr, self.key))
        bind = self._bind_call(lookups)
        return calls + [bind] if bind is not None else calls

    def _bind_call(self, lookups: _Lookups | None = None) -> Call | None:
        """Bind the senders registered since the last look (and publish to them, once
        init() ran), or None when there is nothing to bind. ``lookups`` shares one
        registry read per address among the receivers of one batch."""
        wanted = self._wanted()
        if (
            self._cleared
            or self._status in (KVPoll.Failed, KVPoll.Success)
            or (wanted and len(self._bound) >= wanted)
        ):
            return None
        found = self.mgr._prefill_engines(self.bootstrap_addr, self._explicit, lookups)
        required = self._required
        if not required and found:  # the group's declared size, or all of it that is up
            required = max(len(found), *(e.ranks for e in found))
        new = {e.engine: e.incarnation for e in found if e.engine not in self._bound}
        if not self._explicit:
            new = dict(sorted(new.items())[: max(required - len(self._bound), 0)])
        if not new and required == self._required:
            return None
        self._pending = (new, required)
        return self.store.publish(self.room, self.engine, new, self._payload, required)

    def _absorb(self, st: Status) -> Status:
        if self._pending is not None:  # the batch that carried the binding ran
            new, required = self._pending
            self._pending = None
            self._bound.update(new)
            self._required = required
            self.mgr._watch(self.bootstrap_addr, new)
        return super()._absorb(st)

    def _prepare(
        self,
        kv_indices: object,
        aux_index: int | None,
        state_indices: object | None,
        prefix_len: int,
        dummy: bool,
    ) -> None:
        """Check init()'s arguments, make the pages ready, encode the transfer info."""
        idx = as_indices(kv_indices)
        state = None if state_indices is None else as_indices(state_indices, "state_indices")
        # bounded like page indices (aux) and by msgpack's int64 (prefix): an int too
        # large to encode must be refused here, not surface as msgpack's OverflowError
        if aux_index is not None and (not _is_int(aux_index) or not 0 <= aux_index <= MAX_INDEX):
            raise InvalidIndicesError(f"aux_index must be an int in [0, 2**31), got {aux_index!r}")
        if not _is_int(prefix_len) or not 0 <= prefix_len < 2**63:
            raise InvalidIndicesError(
                f"prefix_len must be an int in [0, 2**63), got {prefix_len!r}"
            )
        if self.mgr.transport is not None and not dummy:
            try:
                self.mgr.transport.expect(self.room, idx)
            except TransportError as exc:
                raise InvalidIndicesError(f"room {self.room}: {exc}") from None
        info = TransferInfo(
            self.engine, idx, aux_index, state, prefix_len, dummy, self.mgr.incarnation
        )
        self._payload = info.encode()

    def _step_call(self, op: str) -> Call:
        """The publish of ``init`` for a batch (KVManager.init_many)."""
        return self.store.publish(
            self.room, self.engine, dict(self._bound), self._payload, self._required
        )

    def init(
        self,
        kv_indices: object,
        aux_index: int | None = None,
        state_indices: object | None = None,
        prefix_len: int = 0,
        dummy: bool = False,
    ) -> KVPoll:
        """Publish where each sender must write; the pages are made ready first. Senders
        that bind later get the same info when they do."""
        self._prepare(kv_indices, aux_index, state_indices, prefix_len, dummy)
        creating = not self._created
        try:
            self._run(
                self.store.publish(
                    self.room, self.engine, dict(self._bound), self._payload, self._required
                )
            )
        except KVStateError as exc:
            err = exc
            self._pending = None  # that batch did not run (or not whole): bind again later
            size = len(self._payload)
            oversize = size >= _MIN_BULK_LIMIT  # Redis hangs up on it: reads as "down"
            if oversize:
                self._payload = b""  # never to be sent again by a later binding
                err = KVStateError(
                    f"room {self.room}: init() failed ({exc}); its transfer info is {size} "
                    "bytes, and Redis drops a connection sent a value above its "
                    "proto-max-bulk-len: raise that, or publish fewer or less fragmented pages"
                )
            if oversize or (creating and self._create_sent):  # it exists: say why
                self._fail_quietly(f"init() refused by Redis: {err}")
            if err is exc:
                raise
            raise err from None
        return self._status

    def _fail_quietly(self, reason: str) -> None:
        """Fail this receiver after an error, when Redis may be what failed."""
        try:
            self._absorb(
                self.store.execute(
                    [self.store.update(self.room, "rx", self.engine, KVPoll.Failed, reason)]
                )[0]
            )
        except KVStateError as exc:
            log.warning("room %s: could not record %r: %s", self.room, reason, exc)

    def _clear_args(self) -> dict[str, Any]:
        return {
            "senders": sorted(set(self._bound) | set(self._pending[0] if self._pending else {})),
            "peer_addr": self.bootstrap_addr,
        }


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
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        if lease <= 0 or bootstrap_timeout < 0 or waiting_timeout < 0 or transfer_timeout <= 0:
            raise ValueError("lease and transfer_timeout must be > 0, timeouts >= 0 (0 = none)")
        if not _is_int(ranks) or ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
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
        self._live: dict[int, _Participant] = {}
        self._watched: set[tuple[str, str, str]] = set()  # (peer engine, addr, incarnation)
        self._misses: dict[tuple[str, str], int] = {}  # (engine, incarnation) -> checks missing
        self._peers: dict[tuple[str, str], EngineInfo] = {}
        self._forked = False
        self._closed = False
        self._taken: Claim | None = None  # who holds our name since our lease lapsed
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
        self._hb_store = store.dedicated()
        self._hb_registry = Registry(self._hb_store)
        try:
            self._hb_registry.register(self.info, lease)
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

    def _check_usable(self, new: bool = False) -> None:
        """Refuse use from a forked child, and (``new``) new participants of a manager
        whose engine name another process holds now."""
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

    def _keep(self, p: _P) -> _P:
        with self._lock:
            self._live[p.room] = p
        return p

    def _forget(self, p: _Participant) -> None:
        with self._lock:
            if self._live.get(p.room) is p:
                del self._live[p.room]

    def _prefill_engines(
        self, addr: str, names: list[str] | None, lookups: _Lookups | None = None
    ) -> list[EngineInfo]:
        """The live prefill engines at ``addr`` (or among ``names``), read fresh for
        each call or batch (``lookups``): a remembered answer would bind a receiver to a
        group that has grown since."""
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
            found = self.registry.at_addr(addr, role="prefill")
        if lookups is not None:
            lookups[memo] = found
        return found

    def _watch(self, addr: str, bound: dict[str, str]) -> None:
        with self._lock:
            self._watched.update((engine, addr, inc) for engine, inc in bound.items())

    def peer(self, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout), cached per incarnation."""
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
        wanted = {check_room(room): indices for room, indices in pages.items()}

        def prepare(p: _Participant) -> None:
            assert isinstance(p, KVReceiver)
            p._prepare(wanted[p.room], None, None, 0, False)

        return self._many(wanted, "init", prepare)

    def clear_many(self, rooms: Iterable[object]) -> dict[int, KVStateError]:
        """``clear()`` of this manager's participants of many rooms in one round trip
        per Redis node. Returns the rooms not cleared, each with its node's
        StateConnectionError (Cluster, node unreachable): they stay live here and can be
        cleared again; rooms without a live participant here are skipped (a clear is
        idempotent). Raises StateConnectionError when no node answered."""
        self._check_usable()
        todo: list[_Participant] = []
        for room in rooms:
            r = check_room(room)
            with self._lock:
                p = self._live.get(r)
            if p is not None and not p._cleared:
                todo.append(p)
        sent = [p for p in todo if p._create_sent]
        errors = self.store.clear_many(
            [self.store.clear_calls(p.room, p.side, p.engine, **p._clear_args()) for p in sent]
        )
        failed = {p.room: e for p, e in zip(sent, errors, strict=True) if e is not None}
        for p in todo:
            if p.room not in failed:
                p._cleared = True
                p._release()
                self._forget(p)
        return dict(failed)

    def _many(
        self,
        rooms: Iterable[object],
        op: str,
        prepare: Callable[[_Participant], None] | None = None,
    ) -> PollResults:
        """One batch of ``op`` (poll, begin, finish, init) over many rooms: creates and
        bindings still due go first in the same batch, one registry read per address;
        ``prepare`` runs on each participant before its calls are made."""
        side = "rx" if op == "init" else "tx"
        if op != "poll" and self.side != side:
            raise KVStateError(
                f"{op}_many is for a {'decode' if side == 'rx' else 'prefill'} manager's "
                f"{'receivers' if side == 'rx' else 'senders'}; {self.engine} is {self.role}"
            )
        plan: list[tuple[int, _Participant | None, int]] = []
        calls: list[Call] = []
        lookups: _Lookups = {}  # receivers still binding: one registry read per address
        for room in rooms:
            r = check_room(room)
            with self._lock:
                p = self._live.get(r)
            if p is not None and p._cleared:
                p = None
            if p is None and op != "poll":
                raise KVStateError(
                    f"room {r}: {self.engine} has no live participant for it; {op}_many "
                    "takes the rooms of this manager's senders or receivers (not cleared)"
                )
            if p is not None:
                if prepare is not None:
                    prepare(p)
                step = (
                    p._step_call(op)
                    if isinstance(p, (KVSender, KVReceiver)) and op != "poll"
                    else None
                )
                more, at = p._batch(step or p._poll_call(), lookups)
                plan.append((r, p, len(calls) + at))
                calls += more
            else:
                plan.append((r, p, len(calls)))
                calls.append(self.store.poll(r, self.side, self.engine))
        try:
            replies = self.store.execute(calls, partial=True)
        except BaseException:
            for _, p, _ in plan:  # bindings in that batch did not run (or not whole)
                if isinstance(p, KVReceiver):
                    p._pending = None
            raise
        out = PollResults()
        for r, p, i in plan:
            st = replies[i]
            if isinstance(st, KVStateError):  # that room's node did not answer
                out.errors[r] = st
                if isinstance(p, KVReceiver):
                    p._pending = None
            elif p is not None:
                p._created = True  # its create, if any, went to the same node
                p._absorb(st)
                out[r] = p.status
            else:
                out[r] = st.status if st.status is not None else KVPoll.Failed
        return out

    # -- peers and leases ------------------------------------------------------------
    def fail_peer(
        self, bootstrap_addr: str, reason: str, engine: str = "", incarnation: str = ""
    ) -> int:
        """Fail every non-terminal receiver bound to a peer; returns how many failed."""
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
                and p._create_sent
                and not p._cleared
            ]
        replies = store.execute([store.fail_receiver(k, engine, incarnation, reason) for k in own])
        return n + sum(int(r) for r in replies)

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
            senders = [
                p
                for p in self._live.values()
                if isinstance(p, KVSender)
                and p._infos
                and not p._cleared
                and not p._peer_failed
                and p._status not in (KVPoll.Failed, KVPoll.Success)
            ]
        writes_to: dict[tuple[str, str], list[KVSender]] = {}
        for snd in senders:
            try:
                incarnations = snd._receiver_incarnations()
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
        self._hb_store.execute(calls)
        for snd in failed:
            snd._peer_failed = True  # once is enough: its next poll reads Failed

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                claim = self._hb_registry.renew(self.info, self.lease)
                if claim.answer == "taken":
                    self._lease_taken(claim)
                    return
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
            mine = [p for p in self._live.values() if p._create_sent and not p._cleared]
        self._hb_store.execute(
            [
                self._hb_store.update(p.room, p.side, self.engine, KVPoll.Failed, reason)
                for p in mine
            ]
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


__all__ = ["KVManager", "KVReceiver", "KVSender"]
