"""UCXTransport: registration, layout, and writes by CMA on one host or UCX puts.

The design (how a write moves bytes, why, limits) is in the docstring of
``transports.ucx``; the settings in ``transports.ucx.settings``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from transports import cma
from transports.base import (
    Geometry,
    LayoutError,
    Target,
    Transport,
    TransportError,
    TransportStats,
)
from transports.pages import check_indices, check_unique
from transports.ucx.abi import (
    MEM_MAP_FIELD_ADDRESS,
    MEM_MAP_FIELD_LENGTH,
    OP_ATTR_FIELD_MEMH,
    MemMapParams,
    RequestParam,
)
from transports.ucx.plan import (
    LAYOUT_VERSION,
    Pairing,
    Plan,
    Region,
    buffer_info,
    make_plans,
)
from transports.ucx.puts import Puts
from transports.ucx.runtime import Runtime
from transports.ucx.settings import UCXSettings

# UCX names the symptom (Endpoint timeout, Connection reset...), not the cause
_PEER_HINT = " (peer dead or unreachable?)"


class UCXTransport(Transport):
    """Writes KV pages into remote processes' buffers with UCX one-sided puts."""

    def __init__(self, settings: UCXSettings | None = None) -> None:
        self.settings = settings or UCXSettings()
        self._rt = Runtime.get(self.settings)
        self._lib = self._rt.lib
        self._regions: list[Region] = []
        self._puts = Puts(self._rt, self.settings.error_handling)
        self._rooms: dict[int, np.ndarray] = {}
        self._no_cma: set[bytes] = set()  # peers where process_vm_writev was refused
        self._pairings: dict[tuple[Any, ...], Pairing] = {}  # each receiver's (make_plans)
        self._identity = cma.Identity.here()
        self._stats = TransportStats()
        self._stats_lock = threading.Lock()
        self._closed = False

    # -- registration -----------------------------------------------------

    def register_buffers(
        self,
        buffers: Sequence[Any],
        page_bytes: Sequence[int],
        geometry: Sequence[Geometry] | None = None,
    ) -> None:
        self._check_open()
        if len(buffers) == 0:
            raise LayoutError("no buffers to register")
        if len(buffers) != len(page_bytes):
            raise LayoutError(
                f"{len(buffers)} buffers but {len(page_bytes)} page sizes: give one per buffer"
            )
        shapes = list(geometry) if geometry is not None else [Geometry()] * len(buffers)
        if len(shapes) != len(buffers):
            raise LayoutError(f"{len(buffers)} buffers but {len(shapes)} geometries")
        names = [g.name for g in shapes if g.name]
        if names and (len(names) != len(shapes) or len(set(names)) != len(names)):
            raise LayoutError("buffer names, when given, must name every buffer once")
        regions = []
        for i, (buf, pb, shape) in enumerate(zip(buffers, page_bytes, shapes, strict=True)):
            addr, nbytes, memory = buffer_info(buf, f"buffer {i}")
            pb = int(pb)
            if pb <= 0:
                raise LayoutError(f"buffer {i}: page size must be positive, got {pb}")
            if nbytes == 0 or nbytes % pb:
                raise LayoutError(
                    f"buffer {i}: {nbytes} bytes is not a whole number of {pb}-byte pages"
                )
            if (
                shape.heads < 0
                or shape.outer < 1
                or (shape.heads and pb % (shape.heads * shape.outer))
            ):
                raise LayoutError(
                    f"buffer {i}: a {pb}-byte page cannot hold {shape.outer} x {shape.heads} "
                    "equal head chunks"
                )
            regions.append(Region(buf, addr, nbytes, pb, nbytes // pb, memory, geometry=shape))
        cma.apply_ptracer(self.settings.ptracer)
        self._rt.call(self._map(regions), timeout=60.0, what="registering buffers")

    async def _map(self, regions: list[Region]) -> None:
        lib = self._lib
        old, self._regions = self._regions, []
        self._pairings.clear()  # they hold the old buffers
        self._unmap(old)
        try:
            for r in regions:
                params = MemMapParams(
                    field_mask=MEM_MAP_FIELD_ADDRESS | MEM_MAP_FIELD_LENGTH,
                    address=r.addr,
                    length=r.nbytes,
                )
                memh = ctypes.c_void_p()
                lib.check(
                    lib.mem_map(self._rt.context_h, ctypes.byref(params), ctypes.byref(memh)),
                    "ucp_mem_map",
                )
                r.memh = memh.value or 0
                packed, size = ctypes.c_void_p(), ctypes.c_size_t()
                lib.check(
                    lib.rkey_pack(
                        self._rt.context_h, r.memh, ctypes.byref(packed), ctypes.byref(size)
                    ),
                    "ucp_rkey_pack",
                )
                r.rkey = ctypes.string_at(packed.value or 0, size.value)
                lib.rkey_buffer_release(packed)
                r.param = RequestParam(op_attr_mask=OP_ATTR_FIELD_MEMH, memh=r.memh)
                self._regions.append(r)
        except BaseException:
            self._unmap(self._regions)
            self._regions = []
            raise

    def _unmap(self, regions: list[Region]) -> None:
        for r in regions:
            if r.memh:
                self._lib.mem_unmap(self._rt.context_h, r.memh)
                r.memh = 0

    def endpoint(self) -> bytes:
        return self._rt.address

    def ucx_env(self) -> dict[str, str]:
        """The UCX variables kvstate has defaults for, as this process's UCX read them."""
        return dict(self._rt.ucx_env)

    def layout(self) -> dict[str, Any]:
        return {
            "transport": "ucx",
            "version": LAYOUT_VERSION,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "id": self._identity.as_dict(),
            "buffers": [r.describe() for r in self._regions],
        }

    # -- receiver side ----------------------------------------------------

    def expect(self, room: int, dst_indices: np.ndarray) -> None:
        """Check the pages exist here; puts are one-sided, so nothing else to prepare."""
        self._check_open()
        if not self._regions:
            raise LayoutError("expect() before register_buffers()")
        num_pages = min(r.num_pages for r in self._regions)
        idx = check_indices(dst_indices, num_pages, f"room {room} destination indices")
        check_unique(idx, f"room {room} destination indices")
        self._rooms[room] = idx

    def release(self, room: int) -> None:
        self._rooms.pop(room, None)

    # -- sender side ------------------------------------------------------

    def write(
        self,
        room: int,
        src_indices: np.ndarray,
        targets: Sequence[Target],
        timeout: float,
    ) -> None:
        self._check_open()
        plans = make_plans(
            room,
            src_indices,
            targets,
            self._regions,
            self._identity if self.settings.cma else None,
            self._no_cma,
            self.settings.put_chunk,
            self._identity,
            self._pairings,
        )
        if not plans:
            self._record(0, 0.0, ok=True)
            return
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            direct = [p for p in plans if p.peer is not None]
            via_ucx = [p for p in plans if p.peer is None]
            fut = None
            if via_ucx:  # runs on the UCX thread while same-host copies run here
                fut = asyncio.run_coroutine_threadsafe(
                    self._puts.write(room, via_ucx, deadline), self._rt.loop
                )
            try:
                refused = [p for p in direct if not self._write_direct(room, p, deadline)]
            finally:
                self._wait_future(fut, room, deadline)
            if refused:  # the kernel would not let us write there: go through UCX
                for p in refused:
                    p.peer = None
                self._wait_future(
                    asyncio.run_coroutine_threadsafe(
                        self._puts.write(room, refused, deadline), self._rt.loop
                    ),
                    room,
                    deadline,
                )
        except TransportError:
            self._record(0, 0.0, ok=False)
            raise
        self._record(sum(p.nbytes for p in plans), time.perf_counter() - started, ok=True)

    def _wait_future(
        self, fut: concurrent.futures.Future[None] | None, room: int, deadline: float
    ) -> None:
        """Wait for a UCX-thread write; the coroutine enforces the deadline itself,
        the margin here only covers a stuck event loop."""
        if fut is None:
            return
        try:
            fut.result(max(0.0, deadline - time.monotonic()) + 0.5)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransportError(f"room {room}: deadline exceeded (UCX thread busy)") from None

    def _write_direct(self, room: int, plan: Plan, deadline: float) -> bool:
        """Same-host write by process_vm_writev; False when the kernel refuses it."""
        assert plan.peer is not None and plan.local_iov is not None
        assert plan.remote_iov is not None

        def check_deadline() -> None:
            if time.monotonic() >= deadline:
                raise TransportError(f"room {room}: deadline exceeded writing into {plan.name}")

        cma.check_alive(plan.peer, plan.name)
        try:
            cma.write_runs(
                plan.peer.pid,
                plan.local_iov,
                plan.remote_iov,
                plan.name,
                check_deadline,
                self.settings.cma_threads,
            )
        except cma.CMAError as exc:
            if exc.errno == errno.EPERM:
                self._no_cma.add(plan.endpoint)
                return False
            if exc.errno == errno.ESRCH:
                raise TransportError(f"room {room}: {plan.name} is gone (process exited)") from None
            raise TransportError(f"room {room}: {exc}") from None
        return True

    def _record(self, nbytes: int, latency: float, ok: bool) -> None:
        with self._stats_lock:
            s = self._stats
            if ok:
                self._stats = TransportStats(
                    s.bytes_moved + nbytes,
                    s.transfers + 1,
                    s.failures,
                    latency if nbytes else s.last_latency_s,
                    nbytes if nbytes else s.last_bytes,
                )
            else:
                self._stats = TransportStats(
                    s.bytes_moved, s.transfers, s.failures + 1, s.last_latency_s, s.last_bytes
                )

    @property
    def stats(self) -> TransportStats:
        return self._stats

    # -- teardown ---------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rooms.clear()
        with contextlib.suppress(TransportError):
            self._rt.call(self._teardown(), timeout=10.0, what="closing the UCX transport")

    async def _teardown(self) -> None:
        self._puts.close()
        self._unmap(self._regions)
        self._regions = []
        self._pairings.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def __enter__(self) -> UCXTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
