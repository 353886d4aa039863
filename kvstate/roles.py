"""KVManager, KVSender and KVReceiver: where room state and KV bytes meet.

A participant is written to Redis with its first operation (poll, init,
abort...), in the same round trip, so creating one costs nothing by itself and
a full lifecycle stays within 8 round trips. ``clear()`` lives once, in the
base class, for every transport.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvstate.codec import MAX_INDEX, TransferInfo, as_indices
from kvstate.errors import (
    InvalidIndicesError,
    KVStateError,
    KVTransferError,
    PeerNotFoundError,
)
from kvstate.gpu import gpu_facts
from kvstate.keys import Side, check_name, check_room
from kvstate.poll import KVPoll, PollResults
from kvstate.registry import EngineInfo, Registry
from kvstate.store import Call, Status, Store
from transports.base import Target, Transport, TransportError

log = logging.getLogger(__name__)
ROLES: dict[str, Side] = {"prefill": "tx", "decode": "rx"}
STATE_LOST = (
    "state lost: the participant's keys are gone (expired, cleared elsewhere, or Redis restarted)"
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Participant:
    """What senders and receivers share: lazy creation, status, abort, the one clear."""

    side: Side

    def __init__(self, mgr: KVManager, room: object, peers: int, fields: dict[str, Any]) -> None:
        if mgr.side != self.side:
            raise KVStateError(f"a {mgr.role} manager cannot make a {type(self).__name__}")
        if not _is_int(peers) or peers < 1:
            raise ValueError(f"the required peer count must be an int >= 1, got {peers!r}")
        self.mgr = mgr
        self.store = mgr.store
        self.room = check_room(room)
        self.engine = mgr.engine
        self.key = self.store.keys.participant(self.room, self.side, self.engine)
        self._fields = {
            "addr": mgr.bootstrap_addr,
            "peers": peers,
            "bootstrap_timeout_ms": int(mgr.bootstrap_timeout * 1000),
            "waiting_timeout_ms": int(mgr.waiting_timeout * 1000),
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
    def _create_calls(self) -> list[Call]:
        if self._created:
            return []
        self._create_sent = True
        return [self.store.create(self.room, self.side, self.engine, self._fields)]

    def _poll_call(self) -> Call:
        return self.store.poll(self.room, self.side, self.engine)

    def _run(self, call: Call) -> Status:
        """Run one operation, creating the participant first if this is its first."""
        if self._cleared:
            return Status(self._status, self._reason)
        replies = self.store.execute([*self._create_calls(), call])
        self._created = True
        return self._absorb(replies[-1])

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

    def fail(self, reason: str) -> KVPoll:
        """Record a failure of this participant only (Failed is sticky)."""
        self._run(self.store.update(self.room, self.side, self.engine, KVPoll.Failed, reason))
        return self._status

    def abort(self, reason: str = "aborted") -> None:
        """Fail every participant of the room, the other side included."""
        if self._cleared:
            return
        self.store.execute(self._create_calls())
        self._created = True
        self.store.abort(self.room, f"{reason} (by {self.side}:{self.engine})")
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
        super().__init__(mgr, room, required_receivers, {})
        self._infos: dict[str, bytes] = {}
        self._decoded: dict[str, TransferInfo] | None = None
        self._num_pages: int | None = None
        self._sent = 0

    def _poll_call(self) -> Call:
        return self.store.poll(self.room, "tx", self.engine, with_infos=True)

    def _absorb(self, st: Status) -> Status:
        if st.infos and st.infos != self._infos:
            self._infos, self._decoded = st.infos, None
        return super()._absorb(st)

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

    def begin_transfer(self) -> KVPoll:
        """-> Transferring, for callers that move the bytes themselves; Failed instead
        (write nothing then) if a receiver failed or vanished meanwhile."""
        receivers = list(self.transfer_infos())
        self._run(self.store.begin(self.room, self.engine, receivers))
        return self._status

    def finish_transfer(self) -> KVPoll:
        """-> Success; acks every receiver, which see Success on their next poll."""
        receivers = list(self.transfer_infos())
        self._run(self.store.finish(self.room, self.engine, receivers))
        return self._status

    def send(self, kv_indices: object, last: bool = True) -> KVPoll:
        """Move these source pages to every receiver (the next slice of each receiver's
        destination pages), then record the state transition."""
        src = as_indices(kv_indices)
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
        targets = self._targets(infos, len(src))
        if self._status != KVPoll.Transferring and self.begin_transfer() != KVPoll.Transferring:
            return self._status
        if self.mgr.transport is not None and targets:
            try:
                self.mgr.transport.write(self.room, src, targets, self.mgr.transfer_timeout)
            except TransportError as exc:
                # the whole room: receivers learn it on their next poll instead of
                # waiting out their timeout for pages that will not come
                self.abort(f"transfer failed: {exc}")
                return self._status
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
            if self.mgr.transport is not None:
                peer = self.mgr.peer(info.receiver, info.incarnation)
                targets.append(Target(peer.endpoint, peer.layout, dst))
        return targets


class KVReceiver(_Participant):
    """The decode side of a room."""

    side: Side = "rx"

    def __init__(self, mgr: KVManager, room: object, bootstrap_addr: str,
                 senders: Sequence[EngineInfo], required_senders: int) -> None:
        self.bootstrap_addr = check_name(bootstrap_addr, "bootstrap_addr")
        self.senders = [s.engine for s in senders]
        bindings = {f"peer:{s.engine}": s.incarnation for s in senders}
        super().__init__(mgr, room, required_senders, {"peer_addr": bootstrap_addr, **bindings})

    def _create_calls(self) -> list[Call]:
        calls = super()._create_calls()
        if calls:
            calls.append(self.store.track(self.bootstrap_addr, self.key))
        return calls

    def init(self, kv_indices: object, aux_index: int | None = None,
             state_indices: object | None = None, prefix_len: int = 0,
             dummy: bool = False) -> KVPoll:
        """Publish where each sender must write; the pages are made ready first."""
        idx = as_indices(kv_indices)
        state = None if state_indices is None else as_indices(state_indices, "state_indices")
        # bounded like page indices (aux) and by msgpack's int64 (prefix): an int too
        # large to encode must be refused here, not surface as msgpack's OverflowError
        if aux_index is not None and (not _is_int(aux_index) or not 0 <= aux_index <= MAX_INDEX):
            raise InvalidIndicesError(f"aux_index must be an int in [0, 2**31), got {aux_index!r}")
        if not _is_int(prefix_len) or not 0 <= prefix_len < 2**63:
            raise InvalidIndicesError(
                f"prefix_len must be an int in [0, 2**63), got {prefix_len!r}")
        if self.mgr.transport is not None and not dummy:
            try:
                self.mgr.transport.expect(self.room, idx)
            except TransportError as exc:
                raise InvalidIndicesError(f"room {self.room}: {exc}") from None
        info = TransferInfo(self.engine, idx, aux_index, state, prefix_len, dummy,
                            self.mgr.incarnation)
        payload = info.encode()
        self._run(self.store.publish(self.room, self.engine, {s: payload for s in self.senders}))
        return self._status

    def _clear_args(self) -> dict[str, Any]:
        return {"senders": self.senders, "peer_addr": self.bootstrap_addr}


class KVManager:
    """One engine rank: registers itself, keeps its lease, makes participants, and
    (on the decode side) watches the peers its rooms are bound to."""

    def __init__(
        self,
        store: Store,
        role: str,
        engine: str,
        bootstrap_addr: str | None = None,
        transport: Transport | None = None,
        *,
        lease: float = 10.0,
        heartbeat_interval: float | None = None,
        bootstrap_timeout: float = 300.0,
        waiting_timeout: float = 300.0,
        transfer_timeout: float = 60.0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        if lease <= 0 or bootstrap_timeout < 0 or waiting_timeout < 0 or transfer_timeout <= 0:
            raise ValueError("lease and transfer_timeout must be > 0, timeouts >= 0 (0 = none)")
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
        self._watched: dict[str, tuple[str, str]] = {}  # peer engine -> (addr, incarnation)
        self._misses: dict[str, int] = {}  # peer engine -> checks in a row without a lease
        self._by_addr: dict[str, list[EngineInfo]] = {}
        self._peers: dict[tuple[str, str], EngineInfo] = {}
        self.info = EngineInfo(
            engine=self.engine,
            role=role,
            addr=self.bootstrap_addr,
            incarnation=self.incarnation,
            endpoint=transport.endpoint() if transport else b"",
            layout=transport.layout() if transport else {},
            gpus=gpu_facts(),
        )
        self.registry.register(self.info, lease)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"kvstate-{engine}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<KVManager {self.role} {self.engine} {self.incarnation} {self.store!r}>"

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- participants --------------------------------------------------------------
    def sender(self, room: object, required_receivers: int = 1) -> KVSender:
        return self._keep(KVSender(self, room, required_receivers))

    def receiver(self, room: object, bootstrap_addr: str, required_senders: int | None = None,
                 senders: Iterable[str] | None = None) -> KVReceiver:
        """A receiver bound to the engines at ``bootstrap_addr`` (all prefill engines
        registered there, or those named in ``senders``)."""
        check_room(room)
        peers = self._resolve(check_name(bootstrap_addr, "bootstrap_addr"), senders)
        rcv = KVReceiver(self, room, bootstrap_addr, peers, required_senders or len(peers))
        with self._lock:
            for p in peers:
                self._watched[p.engine] = (bootstrap_addr, p.incarnation)
        return self._keep(rcv)

    def _keep(self, p: Any) -> Any:
        with self._lock:
            self._live[p.room] = p
        return p

    def _forget(self, p: _Participant) -> None:
        with self._lock:
            if self._live.get(p.room) is p:
                del self._live[p.room]

    def _resolve(self, addr: str, senders: Iterable[str] | None) -> list[EngineInfo]:
        if senders is not None:
            names = [check_name(s, "sender engine") for s in senders]
            found = self.registry.get_many(names)
            missing = [n for n, info in found.items() if info is None]
            if missing:
                raise PeerNotFoundError(
                    f"no live registration for {', '.join(missing)} in namespace "
                    f"{self.store.namespace!r}: is that prefill engine running?"
                )
            return [i for i in found.values() if i is not None]
        with self._lock:
            cached = self._by_addr.get(addr)
        if cached:
            return cached
        peers = self.registry.at_addr(addr, role="prefill")
        if not peers:
            raise PeerNotFoundError(
                f"no prefill engine registered at {addr} in namespace {self.store.namespace!r}; "
                "start it first, or pass senders=[...]"
            )
        with self._lock:
            self._by_addr[addr] = peers
        return peers

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
        plan: list[tuple[int, _Participant | None, int]] = []
        calls: list[Call] = []
        for room in rooms:
            r = check_room(room)
            with self._lock:
                p = self._live.get(r)
            if p is not None and p._cleared:
                p = None
            if p is not None:
                calls += p._create_calls()
                calls.append(p._poll_call())
            else:
                calls.append(self.store.poll(r, self.side, self.engine))
            plan.append((r, p, len(calls) - 1))
        replies = self.store.execute(calls, partial=True)
        out = PollResults()
        for r, p, i in plan:
            st = replies[i]
            if isinstance(st, KVStateError):  # that room's node did not answer
                out.errors[r] = st
            elif p is not None:
                p._created = True  # its create, if any, went to the same node
                p._absorb(st)
                out[r] = p.status
            else:
                out[r] = st.status if st.status is not None else KVPoll.Failed
        return out

    # -- peers and leases ------------------------------------------------------------
    def fail_peer(self, bootstrap_addr: str, reason: str, engine: str = "",
                  incarnation: str = "") -> int:
        """Fail every non-terminal receiver bound to a peer; returns how many failed."""
        n = self.store.fail_bound(check_name(bootstrap_addr, "bootstrap_addr"), engine,
                                  incarnation, reason)
        with self._lock:
            self._by_addr.pop(bootstrap_addr, None)
        return n

    def _check_peers(self) -> None:
        with self._lock:
            watched = dict(self._watched)
        if not watched:
            return
        now = self.registry.incarnations(list(watched))
        for engine, (addr, inc) in watched.items():
            if now[engine] == inc:
                self._misses.pop(engine, None)
                continue
            if now[engine] is None:
                # A lease must be missing on two checks in a row (still well within two
                # lease periods): right after a Redis restart, peers have not yet
                # registered again, and their rooms are not theirs to lose.
                self._misses[engine] = self._misses.get(engine, 0) + 1
                if self._misses[engine] < 2:
                    continue
                why = f"peer {engine} at {addr} lost its lease (incarnation {inc})"
            else:
                why = f"peer {engine} at {addr} restarted (incarnation {inc} -> {now[engine]})"
            n = self.fail_peer(addr, why, engine, inc)
            self._misses.pop(engine, None)
            log.warning("%s: failed %d room(s)", why, n)
            with self._lock:
                if self._watched.get(engine) == (addr, inc):
                    del self._watched[engine]

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                if not self.registry.renew(self.engine, self.incarnation, self.lease):
                    log.warning("lease of %s lapsed; registering again", self.engine)
                    self.registry.register(self.info, self.lease)
                self._check_peers()
            except KVStateError as exc:
                log.warning("heartbeat of %s: %s", self.engine, exc)
            except Exception as exc:  # the lease must outlive any surprise; never die
                log.warning("heartbeat of %s: unexpected %s: %s", self.engine,
                            type(exc).__name__, exc)

    def close(self) -> None:
        """Stop the heartbeat and drop the lease."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with self.store.bounded():  # the join and the drop share one call_timeout
                self._thread.join(timeout=5)
                self.registry.drop(self.engine, self.incarnation)
        except KVStateError as exc:
            log.warning("could not drop the registration of %s: %s", self.engine, exc)


__all__ = ["KVManager", "KVReceiver", "KVSender"]
