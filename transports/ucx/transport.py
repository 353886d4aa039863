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
    WriteJob,
)
from transports.pages import check_indices, check_unique
from transports.ucx.abi import (
    MEM_MAP_FIELD_ADDRESS,
    MEM_MAP_FIELD_LENGTH,
    OP_ATTR_FIELD_MEMH,
    MemMapParams,
    RequestParam,
)
from transports.ucx.buffers import Region, buffer_info
from transports.ucx.pairing import LAYOUT_VERSION, Pairing
from transports.ucx.plan import Plan, make_plans
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
        outcome = self.write_many([(room, src_indices, targets)], timeout)[room]
        if isinstance(outcome, TransportError):
            raise outcome

    def write_many(
        self, jobs: Sequence[WriteJob], timeout: float
    ) -> dict[int, int | TransportError]:
        """``write`` of several rooms together, per receiver: on this host one check that
        it is still the process that published its layout and one series of
        ``process_vm_writev`` calls, through UCX every room's puts and one flush, so a
        step pushing many rooms pays per receiver, not per room. Each room answers its
        bytes moved, or the TransportError that failed it: its own plan refused (as
        ``write`` refuses it, nothing moved for it), or a receiver it writes to failed
        (the other rooms' bytes still land). One deadline, ``timeout``, for them all."""
        self._check_open()
        deadline = time.monotonic() + timeout
        out: dict[int, int | TransportError] = {}
        plans: list[tuple[int, Plan]] = []
        unplanned: set[int] = set()  # refused before a byte moved: not a failed transfer
        for room, src, targets in jobs:
            try:
                made = make_plans(
                    room,
                    src,
                    targets,
                    self._regions,
                    self._identity if self.settings.cma else None,
                    self._no_cma,
                    self.settings.put_chunk,
                    self._identity,
                    self._pairings,
                )
            except TransportError as exc:
                out[room] = exc
                unplanned.add(room)
                continue
            out[room] = sum(p.nbytes for p in made)
            plans += [(room, p) for p in made]
        started = time.perf_counter()
        failed = self._write_plans([p for _, p in plans], deadline) if plans else {}
        took = time.perf_counter() - started
        for room, plan in plans:
            why = failed.get(plan.endpoint)
            if why is not None and not isinstance(out[room], TransportError):
                out[room] = TransportError(f"room {room}: {why}")
        for room, moved in out.items():
            if isinstance(moved, int):
                self._record(moved, took, ok=True)
            elif room not in unplanned:
                self._record(0, 0.0, ok=False)
        return out

    def _write_plans(self, plans: list[Plan], deadline: float) -> dict[bytes, str]:
        """Every plan written, per receiver: those on this host by process_vm_writev here
        while the others' puts run on the UCX thread; a receiver where the kernel
        refused process_vm_writev through UCX after. The receivers that failed, with
        why."""
        direct: dict[bytes, list[Plan]] = {}
        for p in plans:
            if p.peer is not None:
                direct.setdefault(p.endpoint, []).append(p)
        failed: dict[bytes, str] = {}
        via_ucx = [p for p in plans if p.peer is None]
        fut = self._submit(via_ucx, deadline)
        refused: list[Plan] = []
        try:
            for endpoint, group in direct.items():
                try:
                    if not self._write_direct(group, deadline):
                        refused += group
                except TransportError as exc:
                    failed[endpoint] = str(exc)
        finally:
            failed.update(self._wait_future(fut, via_ucx, deadline))
        if refused:  # the kernel would not let us write there: go through UCX
            for p in refused:
                p.peer = None
            failed.update(self._wait_future(self._submit(refused, deadline), refused, deadline))
        return failed

    def _submit(
        self, plans: list[Plan], deadline: float
    ) -> concurrent.futures.Future[dict[bytes, str]] | None:
        """The puts of ``plans``, started on the UCX thread (None: no plans)."""
        if not plans:
            return None
        return asyncio.run_coroutine_threadsafe(
            self._puts.write_each(plans, deadline), self._rt.loop
        )

    def _wait_future(
        self,
        fut: concurrent.futures.Future[dict[bytes, str]] | None,
        plans: list[Plan],
        deadline: float,
    ) -> dict[bytes, str]:
        """The receivers a UCX-thread write failed; the coroutine enforces the deadline
        itself, the margin here only covers a stuck event loop."""
        if fut is None:
            return {}
        try:
            return fut.result(max(0.0, deadline - time.monotonic()) + 0.5)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            return dict.fromkeys((p.endpoint for p in plans), "deadline exceeded (UCX thread busy)")

    def _write_direct(self, plans: list[Plan], deadline: float) -> bool:
        """Same-host write of one receiver's plans by process_vm_writev, one check that
        it is the process that published first; False when the kernel refuses it."""
        first = plans[0]
        assert first.peer is not None and first.local_iov is not None
        assert first.remote_iov is not None
        name = first.name

        def check_deadline() -> None:
            if time.monotonic() >= deadline:
                raise TransportError(f"deadline exceeded writing into {name}")

        cma.check_alive(first.peer, name)
        local, remote = first.local_iov, first.remote_iov
        if len(plans) > 1:
            local = np.concatenate([p.local_iov for p in plans])
            remote = np.concatenate([p.remote_iov for p in plans])
        try:
            cma.write_runs(
                first.peer.pid, local, remote, name, check_deadline, self.settings.cma_threads
            )
        except cma.CMAError as exc:
            if exc.errno == errno.EPERM:
                self._no_cma.add(first.endpoint)
                return False
            if exc.errno == errno.ESRCH:
                raise TransportError(f"{name} is gone (process exited)") from None
            raise TransportError(str(exc)) from None
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
