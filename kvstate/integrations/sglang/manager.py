"""The SGLang KV manager on a kvstate KVManager: one per rank, the registry instead of
the bootstrap HTTP server, a step's polls in one poll_many."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstate.defaults import BOOTSTRAP_TIMEOUT, WAITING_TIMEOUT
from kvstate.errors import KVStateError, StateConnectionError, UnsupportedLayoutError
from kvstate.integrations.sglang.base import BaseManager
from kvstate.integrations.sglang.metrics import count_refusal
from kvstate.integrations.sglang.ranks import PrefillInfo, prefill_engine, prefill_info
from kvstate.integrations.sglang.shape import KVShape
from kvstate.integrations.sglang.spaces import Settings, Spaces, default_memory
from kvstate.integrations.sglang.startup import refuse_unsupported
from kvstate.integrations.sglang_release import check_version
from kvstate.poll import KVPoll
from kvstate.roles import KVManager, KVReceiver, KVSender
from kvstate.store import Store, connect
from transports.base import Transport, TransportError

log = logging.getLogger(__name__)


class Adapter:
    """What the sender and receiver (``participants``) share: admission, the step's
    cached poll, the failure as SGLang's KVTransferError, locking (scheduler and worker
    threads)."""

    kv_mgr: KVStateKVManager
    bootstrap_room: Any
    _part: KVSender | KVReceiver | None

    def _setup(self, mgr: KVStateKVManager, room: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = room
        self.conclude_state: KVPoll | None = None
        self._lock = threading.RLock()
        self._part = None
        self._local_reason = ""
        self._status = KVPoll.Bootstrapping
        self._admitted = False
        reason = mgr._admit(self)
        if reason:
            self._fail_local(reason)
        else:
            self._admitted = True

    @property
    def failed_in_kvstate(self) -> bool:
        """kvstate failed the room (here, or in Redis as of the last poll)."""
        part = self._part
        return bool(self._local_reason) or (part is not None and part.status == KVPoll.Failed)

    def queued(self) -> bool:
        """A decode request bound to its prefill, its pages not published yet."""
        return False

    def _fail_local(self, reason: str) -> None:
        self._local_reason = reason
        self._status = KVPoll.Failed
        self.conclude_state = KVPoll.Failed

    def _guard(self, what: str, fn: Callable[[], Any]) -> None:
        """Run a state call; a kvstate error fails the room instead of the scheduler."""
        try:
            fn()
        except (KVStateError, TransportError) as exc:
            self.kv_mgr._invalidate(self.bootstrap_room)
            log.warning("room %s: %s failed: %s", self.bootstrap_room, what, exc)
            self._fail_local(f"{what} failed: {exc}")
            if self._part is not None:
                with contextlib.suppress(KVStateError):
                    self._part.abort(f"{what} failed: {exc}")
        else:
            # the step's cached poll of this room predates what just changed
            self.kv_mgr._invalidate(self.bootstrap_room)

    def _polled(self, status: KVPoll) -> KVPoll:
        if self._local_reason:
            return KVPoll.Failed
        self._status = status
        if status == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed
        return status

    def failure_exception(self) -> None:
        from sglang.srt.disaggregation.common.conn import KVTransferError

        with self._lock:
            reason = self._local_reason
            if self._part is not None:
                part = self._part
                try:
                    exc = part.failure_exception()  # None: not Failed in Redis
                    part.clear()
                    reason = reason or (exc.reason if exc else "")
                except KVStateError as err:  # a room kvstate cannot read (corrupt)
                    reason = reason or str(err)
                    self._guard("abort", lambda: part.abort(reason))  # fails it, garbage too
                    self._guard("clear", part.clear)
            self._forget()
        raise KVTransferError(self.bootstrap_room, reason or "transfer failed")

    def _abort(self, side: str) -> None:
        with self._lock:
            self.conclude_state = KVPoll.Failed
            part = self._part
            if part is not None:
                self._guard("abort", lambda: part.abort(f"aborted by {side}"))
            elif not self._local_reason:
                self._fail_local(f"aborted by {side}")

    def clear(self) -> None:
        with self._lock:
            if self._part is not None:
                try:
                    self._part.clear()
                except KVStateError as exc:
                    log.warning("room %s: clear failed: %s", self.bootstrap_room, exc)
            self._forget()

    def _forget(self) -> None:
        if self._admitted:
            self.kv_mgr._forget(self)
            self._admitted = False


class KVStateKVManager(BaseManager):
    """One SGLang rank: a kvstate KVManager plus the tables SGLang's scheduler reads."""

    supports_role_switch = False
    supports_deferred_decode_kv_release = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        *,
        store: Store | None = None,
        settings: Settings | None = None,
        transport: Transport | None = None,
        mirror: bool = False,
    ) -> None:
        check_version()
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.disaggregation_mode = disaggregation_mode
        self.settings = settings or Settings.from_env()
        mode = getattr(disaggregation_mode, "value", disaggregation_mode)
        if mode not in ("prefill", "decode"):
            raise UnsupportedLayoutError(f"disaggregation mode {mode!r} needs no transfer backend")
        self.role: str = mode
        pp = int(getattr(server_args, "pp_size", 1) or 1)
        refuse_unsupported(server_args, args, self.role, pp, moves=not mirror)
        self.pp_size = pp
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        self.tp_size = tp // dp if getattr(server_args, "enable_dp_attention", False) else tp
        self.tp_rank = int(getattr(args, "engine_rank", 0) or 0) % max(self.tp_size, 1)
        self.shape = KVShape.of(args, self.tp_size, self.is_mla_backend)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        host = self.settings.host or _host(server_args)
        if self.role == "prefill":
            self.addr = f"{host}:{server_args.disaggregation_bootstrap_port}"
            engine = prefill_engine(self.addr, self.dp_rank, self.tp_rank, self.pp_rank, pp)
        else:
            self.addr = f"{host}:{server_args.port}"
            engine = f"decode@{self.addr}/dp{self.dp_rank}/tp{self.tp_rank}"
        self.store = store or connect(self.settings.url, self.settings.namespace)
        memory = self.settings.memory or default_memory()
        # mirror mode: another backend moves the bytes, kvstate keeps the state only
        self.mirror = mirror
        self.spaces: Transport | None = None
        if not mirror:
            self.spaces = (
                transport
                if transport is not None
                else Spaces(args, memory, shape=self.shape, dp=dp)
            )
        env = os.environ
        waiting = float(env.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(WAITING_TIMEOUT)))
        # a prefill keeps pages for a decode that neither publishes nor holds them for the
        # settings' 30 s; a decode's own receivers wait while its queue holds the request
        # (holds stop only the senders' timeout), so they keep SGLang's 300 s
        bootstrap = self.settings.bootstrap_timeout
        if self.role == "decode":
            bootstrap = float(env.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", BOOTSTRAP_TIMEOUT))
        self.kv = KVManager(
            self.store,
            self.role,
            engine,
            self.addr,
            self.spaces,
            lease=self.settings.lease,
            bootstrap_timeout=bootstrap,
            waiting_timeout=waiting,
            ranks=self.tp_size * pp,  # a DP rank's ranks: ranks.prefill_info waits for all
        )
        self.engine = engine
        # restarted under the same name: fail and clear the rooms the killed process
        # left, so that their other side need not wait for the rooms' timeouts
        self.predecessor_rooms = self.kv.clear_predecessor()
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lock = threading.Lock()
        self._rooms: dict[int, Adapter] = {}
        self._cache: dict[int, KVPoll] = {}
        self._cache_at = 0.0
        self._store_down_since: float | None = None
        self.batches = 0  # poll_many calls (for tests and benchmarks)
        self.refusals: dict[tuple[str, str], int] = {}  # (prefill, reason) -> rooms
        self._held_at = 0.0
        self.holds = 0  # hold_many calls (for tests)

    def register_to_bootstrap(self) -> None:
        """Registration happened in the registry when the manager started (with a lease)."""

    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        self.kv.close()
        if isinstance(self.spaces, Spaces):
            self.spaces.close()

    # -- decode: what SGLang reads in place of the bootstrap server ---------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Fill ``prefill_info_table`` from the registry; False while no prefill rank
        is registered at the address (SGLang retries, then aborts its requests)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            peers = self.kv.registry.at_addr(bootstrap_addr, role="prefill")
        except KVStateError as exc:
            log.warning("looking up prefill %s: %s", bootstrap_addr, exc)
            return False
        info = prefill_info(peers)
        if info is None:
            return False
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return self.try_ensure_parallel_info(bootstrap_addr)

    def refused(self, prefill: str, why: str) -> None:
        """A room this decode cannot load from ``prefill`` (the pair's shapes): counted
        (``refusals``, ``sglang:kv_transfer_refused_total``), WARNING once per pair
        and reason; SGLang fails the request with the reason."""
        with self._lock:
            key = (prefill, why)
            first = key not in self.refusals
            self.refusals[key] = self.refusals.get(key, 0) + 1
        count_refusal(prefill, self.engine)
        if first:
            log.warning("%s cannot load KV from prefill %s: %s", self.engine, prefill, why)

    # -- rooms ---------------------------------------------------------------------------
    def _admit(self, p: Adapter) -> str:
        """Refuse (as a Failed room, with the reason) what must not share or grow state."""
        room = p.bootstrap_room
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
            return f"bootstrap_room must be an int in [0, 2**63), got {room!r}"
        with self._lock:
            other = self._rooms.get(room)
            if other is not None:
                return (
                    f"duplicate bootstrap_room {room}: already in flight on {self.engine}; "
                    "each request needs its own room (refused, not shared)"
                )
            if len(self._rooms) >= self.settings.max_rooms:
                return (
                    f"{len(self._rooms)} rooms in flight on {self.engine}, the cap "
                    "(KVSTATE_SGLANG_MAX_ROOMS); refused"
                )
            self._rooms[room] = p
        return ""

    def _forget(self, p: Adapter) -> None:
        with self._lock:
            if self._rooms.get(p.bootstrap_room) is p:
                del self._rooms[p.bootstrap_room]
            self._cache.pop(p.bootstrap_room, None)

    def _invalidate(self, room: int) -> None:
        with self._lock:
            self._cache.pop(room, None)

    def poll_room(self, p: Adapter) -> KVPoll:
        """One room's status, from this step's batch (one poll_many per node for all
        rooms of the rank); the first room asked again starts the next batch."""
        now = time.monotonic()
        with self._lock:
            fresh = now - self._cache_at < self.settings.step_cache_s
            st = self._cache.pop(p.bootstrap_room, None) if fresh else None
        if st is None:
            self._poll_batch()
            with self._lock:
                st = self._cache.pop(p.bootstrap_room, None)
        return st if st is not None else p._status

    def _poll_batch(self) -> None:
        with self._lock:
            parts = [p for p in self._rooms.values() if p._part is not None and not p._local_reason]
        held = [p for p in parts if p._lock.acquire(blocking=False)]  # busy: mid-send
        try:
            rooms = [p.bootstrap_room for p in held]
            try:
                got = self.kv.poll_many(rooms) if rooms else {}
                self._store_down_since = None
                for p in held:  # a room kvstate cannot read (corrupt) fails alone
                    err = getattr(got, "errors", {}).get(p.bootstrap_room)
                    if err is not None and not isinstance(err, StateConnectionError):
                        p._fail_local(f"kvstate cannot read room {p.bootstrap_room}: {err}")
            except KVStateError as exc:
                self._store_trouble(held, exc)
                got = {}
            self.batches += 1
        finally:
            for p in held:
                p._lock.release()
        with self._lock:
            self._cache = dict(got)
            self._cache_at = time.monotonic()
        self._hold([p.bootstrap_room for p in parts if p.queued()])

    def _hold(self, rooms: list[int]) -> None:
        """Decode: hold the rooms of requests still queued here (bound, pages not
        published yet), so that their prefill keeps the pages past its bootstrap
        timeout for as long as this decode keeps the request (``Store.hold_many``)."""
        now = time.monotonic()
        if not rooms or now - self._held_at < self.settings.hold_for_s / 4:
            return
        self._held_at = now
        try:
            self.store.hold_many(rooms, self.settings.hold_for_s)
            self.holds += 1
        except KVStateError as exc:
            log.warning("%s: holding %d queued rooms failed: %s", self.engine, len(rooms), exc)

    def _store_trouble(self, parts: list[Adapter], exc: KVStateError) -> None:
        """Redis unreachable: keep the last statuses for a grace period, then fail
        the rooms locally (SGLang frees their pages) rather than wait forever."""
        now = time.monotonic()
        if self._store_down_since is None:
            self._store_down_since = now
        log.warning("kvstate poll failed: %s", exc)
        if now - self._store_down_since >= self.settings.store_grace_s:
            for p in parts:
                p._fail_local(
                    f"state store unreachable for {now - self._store_down_since:.0f}s: {exc}"
                )


def _host(server_args: Any) -> str:
    host = getattr(server_args, "host", None)
    if host and host not in ("0.0.0.0", "::"):
        return str(host)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
