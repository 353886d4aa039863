"""kvstate as an SGLang PD-disaggregation transfer backend (``--disaggregation-transfer-backend
kvstate``), loaded through SGLang's ``sglang.srt.plugins`` entry point: no fork, no patch.

What changes against SGLang's own backends
    * Per-room state (status, reasons, transfer infos, prefix length, acks, aborts,
      peer bindings) lives in Redis, not in per-process dicts: an abort from either
      side, or from ``kvstate abort``, reaches the other side on its next poll.
    * Engines register in kvstate's registry with a lease instead of the bootstrap
      HTTP server and ``/health``; a decode rank fails the rooms of a prefill rank
      whose lease lapsed, with the reason.
    * KV pages, the aux/metadata slot and the state slots move through kvstate's
      transport (``transports.ucx``: CMA on one host, UCX otherwise), one transport
      per index space, published together as one layout.
    * A scheduler step's polls cost one ``poll_many`` per Redis node: the first poll
      of a step polls every live room of the rank, the others read that answer.

Settings (environment, read when the manager starts)
    ``KVSTATE_REDIS_URL``, ``KVSTATE_NAMESPACE``: the state store (kvstate's own).
    ``KVSTATE_SGLANG_HOST``: the host this prefill registers under; decode looks the
    prefill up by the ``bootstrap_host:bootstrap_port`` its requests carry, so it must
    be the same string (default: SGLang's ``--host`` unless it is 0.0.0.0, else the
    host's IP).  ``KVSTATE_SGLANG_MAX_ROOMS`` (default 65536): rooms a rank keeps at
    once; more are refused as Failed (a flood of injected rooms cannot grow state
    without bound; each room's keys also carry a TTL).  ``KVSTATE_SGLANG_LEASE``
    (seconds, default 10).  ``KVSTATE_SGLANG_MEMORY``: ``host`` or ``cuda`` for the KV
    pool (default: ``cuda`` when torch sees a GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstate.defaults import BOOTSTRAP_TIMEOUT, LEASE, WAITING_TIMEOUT
from kvstate.errors import KVStateError, PeerNotFoundError
from kvstate.integrations.sglang_plugin import check_version
from kvstate.manager import KVManager
from kvstate.poll import KVPoll
from kvstate.roles import KVReceiver, KVSender
from kvstate.store import Store, connect
from transports.base import Target, Transport, TransportError, TransportStats

log = logging.getLogger(__name__)

_ENGINE = re.compile(r"^(?P<addr>.+)/dp(?P<dp>\d+)/tp(?P<tp>\d+)$")


class UnsupportedLayoutError(KVStateError):
    """A parallel layout the backend refuses (pipeline parallel prefill)."""


# -- settings and buffers ----------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    url: str | None = None
    namespace: str | None = None
    host: str | None = None
    max_rooms: int = 65536
    lease: float = LEASE
    memory: str | None = None
    step_cache_s: float = 0.5  # a cached poll older than this is asked again
    store_grace_s: float = 30.0  # Redis unreachable this long: rooms fail locally

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        return cls(
            url=env.get("KVSTATE_REDIS_URL") or None,
            namespace=env.get("KVSTATE_NAMESPACE") or None,
            host=env.get("KVSTATE_SGLANG_HOST") or None,
            max_rooms=int(env.get("KVSTATE_SGLANG_MAX_ROOMS", "65536")),
            lease=float(env.get("KVSTATE_SGLANG_LEASE", str(LEASE))),
            memory=env.get("KVSTATE_SGLANG_MEMORY") or None,
        )


class _DeviceBuffer:
    """A raw device pointer presented as a 1-D byte array (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def raw_buffer(ptr: int, nbytes: int, memory: str) -> Any:
    """SGLang hands buffers over as (pointer, length): view them without copying."""
    if memory == "cuda":
        return _DeviceBuffer(ptr, nbytes)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def _default_memory() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "host"
    except ImportError:
        return "host"


class Spaces(Transport):
    """KV pages, aux (metadata) slots and each state type's slots are separate index
    spaces: one transport each, published as one layout so one registration carries
    them. ``write`` (what ``KVSender.send`` calls) moves KV pages; ``write_space``
    moves aux and state slots."""

    def __init__(
        self, kv_args: Any, memory: str, factory: Callable[[], Transport] | None = None
    ) -> None:
        if factory is None:
            from transports.ucx import UCXTransport

            factory = UCXTransport
        self.kv = self._space(
            factory, kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens, memory
        )
        if self.kv is None:
            raise UnsupportedLayoutError("SGLang registered no KV buffers (kv_data_ptrs empty)")
        # SGLang keeps the metadata buffers in host memory
        self.aux = self._space(
            factory,
            getattr(kv_args, "aux_data_ptrs", None) or [],
            getattr(kv_args, "aux_data_lens", None) or [],
            getattr(kv_args, "aux_item_lens", None) or [],
            "host",
        )
        ptrs = getattr(kv_args, "state_data_ptrs", None) or []
        lens = getattr(kv_args, "state_data_lens", None) or []
        items = getattr(kv_args, "state_item_lens", None) or []
        self.state = [
            self._space(factory, p, n, i, memory) for p, n, i in zip(ptrs, lens, items, strict=True)
        ]

    @staticmethod
    def _space(
        factory: Callable[[], Transport],
        ptrs: Sequence[int],
        lens: Sequence[int],
        items: Sequence[int],
        memory: str,
    ) -> Transport | None:
        if not ptrs:
            return None
        t = factory()
        t.register_buffers(
            [raw_buffer(int(p), int(n), memory) for p, n in zip(ptrs, lens, strict=True)],
            [int(i) for i in items],
        )
        return t

    def register_buffers(self, buffers: Sequence[Any], page_bytes: Sequence[int]) -> None:
        raise KVStateError("Spaces registers SGLang's buffers itself")

    def endpoint(self) -> bytes:
        assert self.kv is not None
        return self.kv.endpoint()

    def layout(self) -> dict[str, Any]:
        assert self.kv is not None
        return {
            "transport": "kvstate-sglang",
            "kv": self.kv.layout(),
            "aux": self.aux.layout() if self.aux else None,
            "state": [s.layout() if s else None for s in self.state],
        }

    def expect(self, room: int, dst_indices: np.ndarray) -> None:
        assert self.kv is not None
        self.kv.expect(room, dst_indices)

    def write(
        self, room: int, src_indices: np.ndarray, targets: Sequence[Target], timeout: float
    ) -> None:
        assert self.kv is not None
        self.kv.write(
            room,
            src_indices,
            [Target(t.endpoint, t.layout["kv"], t.dst_indices) for t in targets],
            timeout,
        )

    def write_space(
        self,
        space: Transport | None,
        remote: dict[str, Any] | None,
        what: str,
        room: int,
        endpoint: bytes,
        src: np.ndarray,
        dst: np.ndarray,
        timeout: float,
    ) -> None:
        if space is None or remote is None:
            raise TransportError(f"room {room}: {what} is not registered on both sides")
        space.write(room, src, [Target(endpoint, remote, dst)], timeout)

    def release(self, room: int) -> None:
        assert self.kv is not None
        self.kv.release(room)

    def close(self) -> None:
        for t in (self.kv, self.aux, *self.state):
            if t is not None:
                t.close()

    @property
    def stats(self) -> TransportStats:
        assert self.kv is not None
        return self.kv.stats


# -- manager ---------------------------------------------------------------------------


@dataclass
class PrefillInfo:
    """What decode's scheduler reads from ``prefill_info_table`` (found in the registry)."""

    dp_size: int
    tp_size: int
    follow_bootstrap_room: bool = True


def prefill_engine(addr: str, dp_rank: int, tp_rank: int) -> str:
    return f"{addr}/dp{dp_rank}/tp{tp_rank}"


def _sglang_base() -> Any:
    from sglang.srt.disaggregation.base import conn

    return conn


class _Adapter:
    """What the sender and receiver share: admission, the step's cached poll, the
    failure as SGLang's KVTransferError, locking (scheduler and worker threads)."""

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
                exc = self._part.failure_exception()
                reason = reason or exc.reason
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


# SGLang's base classes are abstract; the concrete adapters derive from them so
# isinstance checks in SGLang hold. Importing them here is what the extra installs.
_conn = _sglang_base()
_BaseManager: Any = _conn.BaseKVManager
_BaseSender: Any = _conn.BaseKVSender
_BaseReceiver: Any = _conn.BaseKVReceiver
_BaseServer: Any = _conn.BaseKVBootstrapServer


class KVStateKVManager(_BaseManager):
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
        if pp > 1:
            raise UnsupportedLayoutError(
                f"pipeline parallel size {pp}: kvstate's SGLang backend supports pp_size 1 "
                "only; use the mooncake backend (with kvstate mirror mode) for PP"
            )
        if getattr(
            server_args, "disaggregation_decode_allocation_policy", None
        ) == "prefill_complete" or os.environ.get(
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", ""
        ).lower() in ("1", "true"):
            raise UnsupportedLayoutError(
                "the prefill_complete decode allocation policy and forced prefill DP-rank "
                "queries need SGLang's bootstrap HTTP server; kvstate's backend has none: "
                "use the default allocation policy (the DP rank follows bootstrap_room)"
            )
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        self.tp_size = tp // dp if getattr(server_args, "enable_dp_attention", False) else tp
        self.tp_rank = int(getattr(args, "engine_rank", 0) or 0) % max(self.tp_size, 1)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        host = self.settings.host or _host(server_args)
        if self.role == "prefill":
            self.addr = f"{host}:{server_args.disaggregation_bootstrap_port}"
            engine = prefill_engine(self.addr, self.dp_rank, self.tp_rank)
        else:
            self.addr = f"{host}:{server_args.port}"
            engine = f"decode@{self.addr}/dp{self.dp_rank}/tp{self.tp_rank}"
        self.store = store or connect(self.settings.url, self.settings.namespace)
        memory = self.settings.memory or _default_memory()
        # mirror mode: another backend moves the bytes, kvstate keeps the state only
        self.mirror = mirror
        self.spaces: Transport | None = None
        if not mirror:
            self.spaces = transport if transport is not None else Spaces(args, memory)
        env = os.environ
        waiting = float(env.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(WAITING_TIMEOUT)))
        bootstrap = float(
            env.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", str(BOOTSTRAP_TIMEOUT))
        )
        self.kv = KVManager(
            self.store,
            self.role,
            engine,
            self.addr,
            self.spaces,
            lease=self.settings.lease,
            bootstrap_timeout=bootstrap,
            waiting_timeout=waiting,
        )
        self.engine = engine
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._lock = threading.Lock()
        self._rooms: dict[int, _Adapter] = {}
        self._cache: dict[int, KVPoll] = {}
        self._cache_at = 0.0
        self._store_down_since: float | None = None
        self.batches = 0  # poll_many calls (for tests and benchmarks)

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
        ranks = [m for m in (_ENGINE.match(p.engine) for p in peers) if m]
        if not ranks:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            dp_size=max(int(m["dp"]) for m in ranks) + 1,
            tp_size=max(int(m["tp"]) for m in ranks) + 1,
        )
        return True

    def ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return self.try_ensure_parallel_info(bootstrap_addr)

    # -- rooms ---------------------------------------------------------------------------
    def _admit(self, p: _Adapter) -> str:
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

    def _forget(self, p: _Adapter) -> None:
        with self._lock:
            if self._rooms.get(p.bootstrap_room) is p:
                del self._rooms[p.bootstrap_room]
            self._cache.pop(p.bootstrap_room, None)

    def _invalidate(self, room: int) -> None:
        with self._lock:
            self._cache.pop(room, None)

    def poll_room(self, p: _Adapter) -> KVPoll:
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

    def _store_trouble(self, parts: list[_Adapter], exc: KVStateError) -> None:
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


class KVStateKVSender(_Adapter, _BaseSender):
    """Prefill side of one room."""

    def __init__(
        self,
        mgr: KVStateKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self._aux: int | None = None
        self._num_pages: int | None = None
        self._sent = 0
        self._bytes = 0
        self._latency = 0.0
        if self._admitted:
            self._guard("creating the sender", self._create)

    def _create(self) -> None:
        self._part = self.kv_mgr.kv.sender(self.bootstrap_room, required_receivers=1)

    def poll(self) -> KVPoll:
        if self._part is None or self._local_reason:
            return self._polled(self._status)
        st = self._polled(self.kv_mgr.poll_room(self))
        if st in (KVPoll.WaitingForInput, KVPoll.Transferring):
            assert isinstance(self._part, KVSender)
            infos = self._part._infos
            if len(infos) > 1:
                # a second decode request published into this room (sglang#40125)
                with self._lock:
                    self._guard(
                        "duplicate",
                        lambda: self._part.abort(  # type: ignore[union-attr]
                            f"duplicate bootstrap_room {self.bootstrap_room}: {len(infos)} decode "
                            f"receivers ({', '.join(sorted(infos))}) published into one room; "
                            "refused, not shared"
                        ),
                    )
                return self._polled(KVPoll.Failed)
        return st

    def pop_decode_prefix_len(self) -> int:
        if self._part is None or self._local_reason:
            return 0
        with self._lock:
            try:
                return int(self._part.prefix_len)  # type: ignore[union-attr]
            except KVStateError as exc:
                self._fail_local(f"reading the decode prefix failed: {exc}")
                return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # the last chunk carries aux and state and concludes the room, pages or not
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        with self._lock:
            self._num_pages = int(num_kv_indices)
            self._aux = aux_index
            if self._part is not None:
                self._guard("init", lambda: self._part.init(num_kv_indices))  # type: ignore[union-attr]

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Move this chunk's pages; with the last chunk also the aux slot and the state
        slots, and only then conclude the room (the receiver's Success means all landed)."""
        with self._lock:
            if self._part is None or self._local_reason:
                return
            pages = np.asarray(kv_indices)
            total = self._sent + int(pages.size)
            last = self._num_pages is not None and total >= self._num_pages
            spaces = self.kv_mgr.spaces
            if spaces is None:
                raise KVStateError("send() in mirror mode: the mirrored backend moves the bytes")
            t0 = time.perf_counter()
            before = spaces.stats.bytes_moved
            part = self._part
            assert isinstance(part, KVSender)
            ok = True

            def move() -> None:
                nonlocal ok
                ok = part.send(pages, last=False) == KVPoll.Transferring
                if ok and last:
                    self._send_slots(part, state_indices)
                    part.finish_transfer()

            self._guard("send", move)
            self._sent = total
            self._latency += time.perf_counter() - t0
            self._bytes += spaces.stats.bytes_moved - before

    def _send_slots(self, part: KVSender, state_indices: list[Any] | None) -> None:
        spaces = self.kv_mgr.spaces
        if not isinstance(spaces, Spaces):
            return
        timeout = self.kv_mgr.kv.transfer_timeout
        room = self.bootstrap_room
        state = [
            (i, np.asarray(s, dtype=np.int64).reshape(-1))
            for i, s in enumerate(state_indices or [])
            if s is not None
        ]
        for info in part.transfer_infos().values():
            if info.dummy:
                continue
            peer = self.kv_mgr.kv.peer(info.receiver, info.incarnation)
            if self._aux is not None and info.aux_index is not None:
                spaces.write_space(
                    spaces.aux,
                    peer.layout.get("aux"),
                    "the aux slot",
                    room,
                    peer.endpoint,
                    np.array([self._aux]),
                    np.array([info.aux_index]),
                    timeout,
                )
            dst = (
                np.empty(0, np.int64)
                if info.state_indices is None
                else info.state_indices.astype(np.int64)
            )
            if sum(s.size for _, s in state) != dst.size:
                raise TransportError(
                    f"room {room}: {sum(s.size for _, s in state)} state slots here, "
                    f"{dst.size} published by {info.receiver}"
                )
            remote = peer.layout.get("state") or []
            at = 0
            for i, src in state:
                space = spaces.state[i] if i < len(spaces.state) else None
                spaces.write_space(
                    space,
                    remote[i] if i < len(remote) else None,
                    f"state type {i}",
                    room,
                    peer.endpoint,
                    src,
                    dst[at : at + src.size],
                    timeout,
                )
                at += src.size

    def mirror(self, theirs: int, backend: str) -> KVPoll:
        """Mirror mode: record what the other backend's sender reports and answer
        Failed when kvstate has the room Failed (an abort from anywhere)."""
        ours = self.poll()
        part = self._part
        if ours == KVPoll.Failed or not isinstance(part, KVSender):
            return KVPoll.Failed
        with self._lock:
            if theirs == KVPoll.Failed:
                self._guard(
                    "recording the failure",
                    lambda: part.fail(f"{backend} reported the transfer failed"),
                )
                return KVPoll.Failed
            if theirs == KVPoll.Success and ours != KVPoll.Success:
                self.mirror_begin()
                if part.status == KVPoll.Transferring:
                    self._guard("finish_transfer", part.finish_transfer)
        return KVPoll(int(theirs))

    def mirror_begin(self) -> None:
        """Mirror mode: the other backend starts moving pages (Transferring, once)."""
        with self._lock:
            part = self._part
            if isinstance(part, KVSender) and part.status == KVPoll.WaitingForInput:
                self._guard("begin_transfer", part.begin_transfer)

    def get_transfer_metric(self) -> Any:
        return _conn.KVTransferMetric(
            transfer_latency_s=self._latency, transfer_total_bytes=self._bytes
        )

    def mark_prefill_complete(self) -> None:
        """Nothing to publish early: decode allocates before prefill runs."""

    def abort(self) -> None:
        self._abort("prefill")


class KVStateKVReceiver(_Adapter, _BaseReceiver):
    """Decode side of one room. SGLang's WaitingForInput means "handshake done, send
    the metadata"; kvstate's means "metadata published": the adapter reports
    WaitingForInput after ``init()`` until ``send_metadata()``, then Transferring
    until the sender concluded."""

    def __init__(
        self, mgr: KVStateKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._metadata_sent = False

    def init(self, prefill_dp_rank: int) -> None:
        with self._lock:
            if self._local_reason or self._part is not None:
                return
            mgr = self.kv_mgr
            info = mgr.prefill_info_table.get(self.bootstrap_addr)
            if info is not None and info.tp_size != mgr.tp_size:
                self._fail_local(
                    f"TP mismatch: prefill at {self.bootstrap_addr} has attention TP size "
                    f"{info.tp_size}, this decode {mgr.tp_size}; kvstate's SGLang backend "
                    "maps rank i to rank i and needs equal sizes"
                )
                return
            sender = prefill_engine(self.bootstrap_addr, int(prefill_dp_rank or 0), mgr.tp_rank)
            try:
                self._part = mgr.kv.receiver(
                    self.bootstrap_room, self.bootstrap_addr, required_senders=1, senders=[sender]
                )
            except PeerNotFoundError as exc:
                self._fail_local(str(exc))
            except KVStateError as exc:
                self._fail_local(f"binding to {sender} failed: {exc}")

    def poll(self) -> KVPoll:
        if self._part is None or self._local_reason:
            return self._polled(self._status)
        st = self.kv_mgr.poll_room(self)
        if st in (KVPoll.Failed, KVPoll.Success):
            return self._polled(st)
        self._status = st
        return KVPoll.Transferring if self._metadata_sent else KVPoll.WaitingForInput

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        with self._lock:
            if self._part is None or self._local_reason:
                return
            if getattr(destination, "value", destination) == "host":
                self._fail_local("host KV destinations are not supported by kvstate's backend")
                return
            parts = [
                np.asarray(s, dtype=np.int64).reshape(-1)
                for s in state_indices or []
                if s is not None
            ]
            state = np.concatenate(parts) if parts else None
            part = self._part
            assert isinstance(part, KVReceiver)
            self._guard(
                "send_metadata",
                lambda: part.init(
                    kv_indices, aux_index, state, prefix_len=int(decode_prefix_len or 0)
                ),
            )
            self._metadata_sent = True

    def abort(self) -> None:
        self._abort("decode")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The abort is in Redis already; the prefill learns it on its next poll."""

    def mirror(self, theirs: int, backend: str) -> KVPoll:
        """Mirror mode: the other backend's status unless kvstate has the room Failed
        (a prefill abort, a lost prefill lease, ``kvstate abort``)."""
        ours = self.poll()
        if ours == KVPoll.Failed:
            return KVPoll.Failed
        if theirs == KVPoll.Failed and self._part is not None:
            part = self._part
            with self._lock:
                self._guard(
                    "recording the failure",
                    lambda: part.fail(f"{backend} reported the transfer failed"),
                )
            return KVPoll.Failed
        return KVPoll(int(theirs))


class KVStateBootstrapServer(_BaseServer):
    """Stands where SGLang starts its bootstrap HTTP server: kvstate needs none
    (engines register in Redis with a lease), so this only says so."""

    def __init__(self, host: str, port: int, **_: Any) -> None:
        self.host = host
        self.port = port
        log.info(
            "kvstate backend: no bootstrap server on %s:%s; prefill ranks register "
            "in kvstate's registry",
            host,
            port,
        )

    def close(self) -> None:
        """Nothing to stop."""


# -- mirror mode ----------------------------------------------------------------------


_MIRRORS: dict[type, type] = {}


def mirrored(base: type, kind: str, backend: str) -> type:
    """``base`` (another backend's manager, sender or receiver class) with kvstate
    keeping the per-room state beside it: the bytes still go the base's way."""
    key = base
    if key not in _MIRRORS:
        body = {"manager": _mirror_manager, "sender": _mirror_sender, "receiver": _mirror_receiver}[
            kind
        ](base, backend)
        _MIRRORS[key] = type(f"KVStateMirror{base.__name__}", (base,), body)
    return _MIRRORS[key]


def _mirror_manager(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        **kw: Any,
    ) -> None:
        base.__init__(self, args, disaggregation_mode, server_args, is_mla_backend, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVManager(
            args, disaggregation_mode, server_args, is_mla_backend, mirror=True
        )

    return {"__init__": __init__}


def _mirror_sender(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any, mgr: Any, bootstrap_addr: str, bootstrap_room: int, *a: Any, **kw: Any
    ) -> None:
        base.__init__(self, mgr, bootstrap_addr, bootstrap_room, *a, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVSender(mgr.kvstate, bootstrap_addr, bootstrap_room)

    def poll(self: Any) -> KVPoll:
        return self.kvstate.mirror(base.poll(self), backend)  # type: ignore[attr-defined, no-any-return]

    def send(self: Any, *a: Any, **kw: Any) -> Any:
        self.kvstate.mirror_begin()
        return base.send(self, *a, **kw)  # type: ignore[attr-defined]

    return {"__init__": __init__, "poll": poll, "send": send, **_mirror_common(base)}


def _mirror_receiver(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any,
        mgr: Any,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
        *a: Any,
        **kw: Any,
    ) -> None:
        base.__init__(self, mgr, bootstrap_addr, bootstrap_room, *a, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVReceiver(mgr.kvstate, bootstrap_addr, bootstrap_room)

    def init(self: Any, prefill_dp_rank: int, *a: Any, **kw: Any) -> Any:
        self.kvstate.init(prefill_dp_rank)
        return base.init(self, prefill_dp_rank, *a, **kw)  # type: ignore[attr-defined]

    def send_metadata(
        self: Any,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        *a: Any,
        **kw: Any,
    ) -> Any:
        # published in kvstate before the other backend can see the metadata, so the
        # prefill's kvstate sender is ready when its transfer starts
        self.kvstate.send_metadata(
            kv_indices, aux_index, state_indices, kw.get("decode_prefix_len")
        )
        return base.send_metadata(self, kv_indices, aux_index, state_indices, *a, **kw)  # type: ignore[attr-defined]

    def poll(self: Any) -> KVPoll:
        return self.kvstate.mirror(base.poll(self), backend)  # type: ignore[attr-defined, no-any-return]

    return {
        "__init__": __init__,
        "init": init,
        "send_metadata": send_metadata,
        "poll": poll,
        **_mirror_common(base),
    }


def _mirror_common(base: type) -> dict[str, Any]:
    def failure_exception(self: Any) -> None:
        """kvstate's reason when kvstate failed the room (an abort the other backend
        never heard of), else the other backend's own exception."""
        st = self.kvstate
        if st._local_reason or (st._part is not None and st._part.status == KVPoll.Failed):
            with contextlib.suppress(Exception):
                base.failure_exception(self)  # type: ignore[attr-defined]  # its own cleanup
            st.failure_exception()  # raises SGLang's KVTransferError with the reason
        st.clear()
        base.failure_exception(self)  # type: ignore[attr-defined]

    def abort(self: Any) -> None:
        self.kvstate.abort()
        base.abort(self)  # type: ignore[attr-defined]

    def clear(self: Any) -> None:
        self.kvstate.clear()
        base.clear(self)  # type: ignore[attr-defined]

    return {"failure_exception": failure_exception, "abort": abort, "clear": clear}


__all__ = [
    "KVStateBootstrapServer",
    "KVStateKVManager",
    "KVStateKVReceiver",
    "KVStateKVSender",
    "PrefillInfo",
    "Settings",
    "Spaces",
    "UnsupportedLayoutError",
    "prefill_engine",
    "mirrored",
    "raw_buffer",
]
