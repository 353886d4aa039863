"""UCX transport on ``ucxx``: one-sided writes of page runs, complete before returning.

How a write moves bytes
    The receiver registers its buffers (``ucp_mem_map``) and publishes, in
    ``layout()``, their addresses, page sizes, packed UCX remote keys and who it
    is (boot id, pid namespace, pid, start time); ``endpoint()`` is its UCX
    worker address. The sender merges the pages into runs contiguous on both
    sides (``transports.pages``) and then, per target:

    * same host, host memory on both sides: ``process_vm_writev`` with up to
      1024 runs per system call (``transports.cma``); when it returns the bytes
      are in the receiver's pages;
    * otherwise (another host, GPU memory, a kernel that refuses CMA):
      ``ucp_put_nbx`` per run and layer, then ``ucp_ep_flush_nbx``; the flush
      completes only when every put is complete at the receiver.

    Over RDMA or CMA the receiver's CPU takes no part; over TCP, UCX emulates
    puts with active messages that the receiver's UCX thread copies in.
    ``write`` returns only after remote completion, or raises
    :class:`TransportError` with a reason.

Why this split (measured here, 2 vCPUs, UCX 1.21; ``tools/bench_transfer.py``)
    * ucxx 0.52 has no RMA in Python; a Python-level message costs 55-200 us,
      so one message per run made fragmented transfers 4x slower. Puts go
      through ctypes on the libucp that ucxx loaded (~3 us per put to post).
    * UCX's own CMA lane is only selected for endpoints WITHOUT error handling,
      and on those a put into a process that has died aborts the sender
      (``cma_ep.c`` logs the failed ``process_vm_writev`` at fatal level; seen
      with a SIGKILLed receiver). With error handling on, UCX uses TCP on one
      host (0.3-0.7 GB/s for puts). Issuing the same system call ourselves
      keeps CMA speed (4.5-5.8 GB/s, fragmented within 0.85-0.95 of contiguous,
      on par with an in-process memcpy) and turns a dead peer into ESRCH.
    * Packing runs into a staging buffer and scattering on the receiver would
      add two copies on a 2-core host; not needed with either path above.

Settings (each can be overridden)
    * UCX endpoints are made from worker addresses WITH error handling
      (``KVSTATE_UCX_ERROR_HANDLING=0`` turns it off: faster on one host, but a
      dead peer then aborts this process; for trusted benchmarks only). Every
      wait still has a deadline: a vanished host sends no reset.
    * ``KVSTATE_UCX_CMA=0`` sends same-host transfers through UCX puts too.
    * Progress mode ``blocking`` (``KVSTATE_UCX_PROGRESS_MODE``; ``polling``
      is accepted). ``thread`` is refused: its progress thread would race the
      ctypes calls, which must run on the thread that progresses the worker.
      Blocking beat thread by 1.5-2x on 2 cores; polling spins a core. In
      blocking mode the transport re-arms the worker after progress itself
      (ucxx 0.52 does not, and its loop then spins a core while idle).
    * ``UCX_DEFAULTS`` are exported unless the environment sets them (the
      environment wins; ``ucx_env()`` says what is in effect):
      ``UCX_TCP_TX_SEG_SIZE=256K`` and ``UCX_TCP_RX_SEG_SIZE=512K`` (UCX: 8K
      and 64K). With error handling on, UCX has no zero-copy put over TCP and
      emulates each put with active messages of at most one TX segment
      (``UCX_PROTO_INFO=y`` shows it), so 8K segments meant 2048 messages per
      16 MiB put. Measured between two network namespaces over a veth pair,
      settings timed in turn (``tools/bench_transfer.py --cross-host``; the
      README has the figures): fragmented pages 1.4-1.5 -> 3.6 GB/s,
      contiguous unchanged (1.5-1.6); 1M/2M: contiguous 1.9-2.1, fragmented
      3.1-3.3, at 4-6x the memory below.
      Cost: the segments come from UCX memory pools that grow per connection
      in use: +0.3 MiB resident per process for one peer moving 64 MiB, +1.0
      MiB on a sender writing to 4 receivers (+0.4 MiB on each receiver),
      against UCX's defaults. TX must not exceed RX (UCX refuses it; checked
      here with a clear error). RDMA, cuda_ipc and shared memory ignore them.
    * ``UCX_TLS``, ``UCX_RNDV_SCHEME`` and the rest are left to UCX unless set
      in the environment (puts do not use rendezvous; UCX picks RDMA,
      cuda_ipc or TCP as available). ``UCX_WARN_UNUSED_ENV_VARS=n`` is a
      default because ucxx sets a variable UCX 1.21 no longer knows.
    * ``KVSTATE_CMA_PTRACER``: ``off`` (default), ``any`` or one sender pid;
      see ``transports.cma``. Applied at ``register_buffers`` and logged once.

Threads and processes
    ``ucxx``'s asyncio loop lives in one daemon thread per process, shared by
    every ``UCXTransport`` in it; public methods are synchronous and wait with
    a deadline. Same-host copies run on the calling thread (the system call
    releases the GIL). Start processes that use UCX with the multiprocessing
    ``spawn`` method and create the transport after starting them.

Limits
    Device arrays (``__cuda_array_interface__``) are registered in place; UCX
    does not synchronise CUDA streams, so finish writing the KV pages before
    ``write``. One-sided writes cannot be refused by the receiver: a sender
    that outlives a room's deadline could still write that room's pages, so
    the caller must not hand pages of a failed room to a new request until the
    sender is known to have stopped (kvstate's room state does that). The
    ctypes declarations of two UCP structs are checked against the UCX
    version at start-up (tested with 1.21 from ``libucx-cu12``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import hashlib
import os
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from transports import cma
from transports.base import LayoutError, Target, Transport, TransportError, TransportStats
from transports.pages import check_indices, check_unique, merge_runs

__all__ = ["UCXSettings", "UCXTransport", "run_on_ucx_thread"]

LAYOUT_VERSION = 1
# UCX names the symptom (Endpoint timeout, Connection reset...), not the cause
_PEER_HINT = " (peer dead or unreachable?)"
_ARM_TRIES = 64  # progress calls per wake-up before the event loop gets a turn
_T = TypeVar("_T")

# ---------------------------------------------------------------------------
# libucp through ctypes: only what ucxx does not expose (RMA and flush).

_UCS_OK = 0
_UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _UCS_ERR_LAST  # UCS_PTR_IS_ERR: ptr >= (uintptr_t)UCS_ERR_LAST

_MEM_MAP_FIELD_ADDRESS = 1 << 0
_MEM_MAP_FIELD_LENGTH = 1 << 1
_OP_ATTR_FIELD_MEMH = 1 << 8


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class _RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class _LibUCP:
    """The libucp already loaded by ucxx (found in /proc/self/maps, not a second copy)."""

    def __init__(self) -> None:
        path = self._loaded_path()
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        major, minor, release = u(), u(), u()
        lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.version = (major.value, minor.value, release.value)
        if major.value != 1 or minor.value < 16:
            raise TransportError(
                f"UCX {major.value}.{minor.value} found at {path}: the ctypes declarations "
                "here are written for UCX 1.16-1.x (tested with 1.21)"
            )

        def fn(name: str, res: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = list(args)
            return f

        self.mem_map = fn(
            "ucp_mem_map", ctypes.c_int, vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)
        )
        self.mem_unmap = fn("ucp_mem_unmap", ctypes.c_int, vp, vp)
        self.rkey_pack = fn(
            "ucp_rkey_pack", ctypes.c_int, vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)
        )
        self.rkey_buffer_release = fn("ucp_rkey_buffer_release", None, vp)
        self.ep_rkey_unpack = fn(
            "ucp_ep_rkey_unpack", ctypes.c_int, vp, ctypes.c_char_p, ctypes.POINTER(vp)
        )
        self.rkey_destroy = fn("ucp_rkey_destroy", None, vp)
        self.put_nbx = fn(
            "ucp_put_nbx", vp, vp, vp, sz, ctypes.c_uint64, vp, ctypes.POINTER(_RequestParam)
        )
        self.ep_flush_nbx = fn("ucp_ep_flush_nbx", vp, vp, ctypes.POINTER(_RequestParam))
        self.request_check_status = fn("ucp_request_check_status", ctypes.c_int, vp)
        self.request_free = fn("ucp_request_free", None, vp)
        self._status_string = fn("ucs_status_string", ctypes.c_char_p, ctypes.c_int)

    @staticmethod
    def _loaded_path() -> str:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libucp.so"):
                    return path
        raise TransportError("libucp is not loaded in this process (ucxx import failed?)")

    def status_string(self, status: int) -> str:
        text = self._status_string(status)
        return text.decode() if text else f"UCX status {status}"

    def check(self, status: int, what: str) -> None:
        if status != _UCS_OK:
            raise TransportError(f"{what} failed: {self.status_string(status)}")


def _ptr_status(ptr: int | None) -> int:
    """UCS_PTR_STATUS for a ``ucs_status_ptr_t``: 0 done, 1 pending request, <0 error."""
    if not ptr:
        return _UCS_OK
    if ptr >= _PTR_ERR_MIN:
        return ptr - (1 << 64)
    return _UCS_INPROGRESS


# ---------------------------------------------------------------------------
# Settings and the per-process UCX thread.


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "y", "yes", "true", "on")


#: UCX variables set for this process unless its environment already sets them
#: (the environment wins). Why each, with measurements: the module docstring.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "512K",
}

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
}


def _size(raw: str) -> int | None:
    """A UCX memory size ("256K", "1m", "65536") in bytes; None if not one."""
    text = raw.strip().upper()
    digits = text.rstrip("BKMG")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        return None
    return int(digits) * _SIZE_UNITS[unit]


@dataclass(frozen=True)
class UCXSettings:
    """UCX knobs; defaults come from the environment (see the module docstring)."""

    progress_mode: str = field(
        default_factory=lambda: os.environ.get("KVSTATE_UCX_PROGRESS_MODE", "blocking")
    )
    error_handling: bool = field(
        default_factory=lambda: _env_flag("KVSTATE_UCX_ERROR_HANDLING", True)
    )
    cma: bool = field(default_factory=lambda: _env_flag("KVSTATE_UCX_CMA", True))
    tls: str | None = field(default_factory=lambda: os.environ.get("UCX_TLS"))
    rndv_scheme: str | None = field(default_factory=lambda: os.environ.get("UCX_RNDV_SCHEME"))
    #: who may ptrace (and so CMA-write into) this process: "off", "any" or a pid
    ptracer: str | int = field(
        default_factory=lambda: cma.parse_ptracer(os.environ.get(cma.PTRACER_ENV))
    )

    def apply_env(self) -> dict[str, str]:
        """Export the UCX variables (UCX reads them once, when ucxx creates its context);
        return the values in effect for the ones kvstate has defaults for."""
        for name, value in UCX_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if self.tls:
            os.environ["UCX_TLS"] = self.tls
        if self.rndv_scheme:
            os.environ["UCX_RNDV_SCHEME"] = self.rndv_scheme
        tx = _size(os.environ["UCX_TCP_TX_SEG_SIZE"])
        rx = _size(os.environ["UCX_TCP_RX_SEG_SIZE"])
        if tx is not None and rx is not None and tx > rx:
            raise TransportError(
                f"UCX_TCP_TX_SEG_SIZE={os.environ['UCX_TCP_TX_SEG_SIZE']} is larger than "
                f"UCX_TCP_RX_SEG_SIZE={os.environ['UCX_TCP_RX_SEG_SIZE']}: UCX refuses that; "
                "set both (kvstate's defaults: 256K and 512K)"
            )
        return {name: os.environ[name] for name in UCX_DEFAULTS}


class _Runtime:
    """ucxx's context, worker and asyncio loop, in one daemon thread per process."""

    _instance: _Runtime | None = None
    _guard = threading.Lock()

    @classmethod
    def get(cls, settings: UCXSettings) -> _Runtime:
        with cls._guard:
            if cls._instance is None:
                cls._instance = cls(settings)
            elif cls._instance.settings.progress_mode != settings.progress_mode:
                raise TransportError(
                    "UCX is already running in this process with progress mode "
                    f"{cls._instance.settings.progress_mode!r}"
                )
            return cls._instance

    def __init__(self, settings: UCXSettings) -> None:
        if settings.progress_mode not in ("blocking", "polling"):
            raise TransportError(
                f"progress mode {settings.progress_mode!r} not supported: use 'blocking' or "
                "'polling' (puts must be posted on the thread that progresses the worker)"
            )
        self.settings = settings
        self.ucx_env = settings.apply_env()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="kvstate-ucx", daemon=True)
        self.thread.start()
        try:
            self.call(self._init(), timeout=60.0, what="starting UCX")
        except Exception as exc:
            ucx = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
            raise TransportError(
                f"starting UCX failed: {exc}; check the UCX_* variables in effect: {ucx}"
            ) from exc

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> None:
        import ucxx  # heavy import, and UCX must see the environment set above

        ucxx.init(progress_mode=self.settings.progress_mode)
        self.ctx = ucxx.core._get_ctx()
        self.ucxx = ucxx
        self.context_h: int = self.ctx.context.handle
        self.worker = self.ctx.worker
        self.address: bytes = bytes(ucxx.get_worker_address())
        self.lib = _LibUCP()
        if self.settings.progress_mode == "blocking":
            # ucxx 0.52's blocking mode progresses once per wake-up of the worker's epoll
            # fd but never re-arms the worker, so after the first event the fd stays
            # readable and the loop spins a core for good (measured: 55-97% CPU in idle
            # processes after one transfer). Start it now and take over its fd reader.
            self.ctx.continuous_ucx_progress(self.loop)
            fd = self.worker.epoll_file_descriptor
            self.loop.remove_reader(fd)
            self.loop.add_reader(fd, self._on_ucx_event)

    def _on_ucx_event(self) -> None:
        """Progress until UCX agrees to arm the worker (nothing left pending), so the fd
        only wakes the loop for new events; give the loop back after a bounded burst."""
        for _ in range(_ARM_TRIES):
            self.worker.progress()
            if self.worker.arm():
                return

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        """Run ``coro`` on the UCX thread and wait at most ``timeout`` seconds."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransportError(
                f"{what}: deadline of {timeout:.3g}s exceeded (UCX thread busy)"
            ) from None


# ---------------------------------------------------------------------------
# Buffers, peers and transfer plans.


@dataclass
class _Region:
    """One registered buffer (a layer or kind of KV cache)."""

    obj: Any  # keeps the caller's array alive while UCX has it mapped
    addr: int
    nbytes: int
    page_bytes: int
    num_pages: int
    memory: str  # "host" or "cuda"
    memh: int = 0
    rkey: bytes = b""
    param: _RequestParam = field(default_factory=_RequestParam)


@dataclass
class _Peer:
    """An endpoint to a receiver's worker plus the remote keys unpacked on it."""

    name: str
    ep: Any  # ucxx Endpoint; keeps the UCP endpoint alive
    ep_h: int
    rkeys: dict[bytes, int] = field(default_factory=dict)


@dataclass
class _Plan:
    """Everything one target needs, computed and validated before any byte moves."""

    endpoint: bytes
    name: str
    rkeys: list[bytes]
    # per layer: (local addresses, remote addresses, byte counts) as Python lists
    ops: list[tuple[list[int], list[int], list[int]]]
    nbytes: int
    # same-host peer reachable by process_vm_writev: its identity and iovec arrays
    peer: cma.Identity | None = None
    local_iov: np.ndarray | None = None
    remote_iov: np.ndarray | None = None


def _buffer_info(obj: Any, what: str) -> tuple[int, int, str]:
    """(address, nbytes, memory kind) of a C-contiguous array, without copying it."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(s) for s in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
        if strides is not None:
            expected, step = [], itemsize
            for dim in reversed(shape):
                expected.append(step)
                step *= dim
            if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
                raise LayoutError(f"{what}: device array is not C-contiguous (strides {strides})")
        return int(cai["data"][0]), int(np.prod(shape)) * itemsize, "cuda"
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__array_interface__"):
            view = memoryview(np.asarray(obj))  # type: ignore[arg-type]
        elif callable(getattr(obj, "numpy", None)):  # a CPU torch tensor: a view, no copy
            view = memoryview(obj.numpy())
        else:
            raise LayoutError(
                f"{what}: {type(obj).__name__} is neither a buffer nor a CUDA array"
            ) from None
    if not view.c_contiguous:
        raise LayoutError(f"{what}: array is not C-contiguous (UCX would send its raw memory)")
    flat = np.frombuffer(
        view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8
    )
    return int(flat.__array_interface__["data"][0]), flat.nbytes, "host"


def _short_name(endpoint: bytes, layout: dict[str, Any]) -> str:
    """A readable peer name for error messages."""
    tag = hashlib.blake2b(endpoint, digest_size=4).hexdigest()
    pid, host = layout.get("pid"), layout.get("host")
    return f"peer {tag} (pid {pid} on {host})" if pid is not None else f"peer {tag}"


# ---------------------------------------------------------------------------


class UCXTransport(Transport):
    """Writes KV pages into remote processes' buffers with UCX one-sided puts."""

    def __init__(self, settings: UCXSettings | None = None) -> None:
        self.settings = settings or UCXSettings()
        self._rt = _Runtime.get(self.settings)
        self._lib = self._rt.lib
        self._regions: list[_Region] = []
        self._peers: dict[bytes, _Peer] = {}
        self._rooms: dict[int, np.ndarray] = {}
        self._no_cma: set[bytes] = set()  # peers where process_vm_writev was refused
        self._identity = cma.Identity.here()
        self._stats = TransportStats()
        self._stats_lock = threading.Lock()
        self._closed = False

    # -- registration -----------------------------------------------------

    def register_buffers(self, buffers: Sequence[Any], page_bytes: Sequence[int]) -> None:
        self._check_open()
        if len(buffers) == 0:
            raise LayoutError("no buffers to register")
        if len(buffers) != len(page_bytes):
            raise LayoutError(
                f"{len(buffers)} buffers but {len(page_bytes)} page sizes: give one per buffer"
            )
        regions = []
        for i, (buf, pb) in enumerate(zip(buffers, page_bytes, strict=True)):
            addr, nbytes, memory = _buffer_info(buf, f"buffer {i}")
            pb = int(pb)
            if pb <= 0:
                raise LayoutError(f"buffer {i}: page size must be positive, got {pb}")
            if nbytes == 0 or nbytes % pb:
                raise LayoutError(
                    f"buffer {i}: {nbytes} bytes is not a whole number of {pb}-byte pages"
                )
            regions.append(_Region(buf, addr, nbytes, pb, nbytes // pb, memory))
        cma.apply_ptracer(self.settings.ptracer)
        self._rt.call(self._map(regions), timeout=60.0, what="registering buffers")

    async def _map(self, regions: list[_Region]) -> None:
        lib = self._lib
        old, self._regions = self._regions, []
        self._unmap(old)
        try:
            for r in regions:
                params = _MemMapParams(
                    field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH,
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
                r.param = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMH, memh=r.memh)
                self._regions.append(r)
        except BaseException:
            self._unmap(self._regions)
            self._regions = []
            raise

    def _unmap(self, regions: list[_Region]) -> None:
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
            "buffers": [
                {
                    "addr": r.addr,
                    "nbytes": r.nbytes,
                    "page_bytes": r.page_bytes,
                    "num_pages": r.num_pages,
                    "memory": r.memory,
                    "rkey": r.rkey,
                }
                for r in self._regions
            ],
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
        plans = self._plan(room, src_indices, targets)
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
                    self._write(room, via_ucx, deadline), self._rt.loop
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
                        self._write(room, refused, deadline), self._rt.loop
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

    def _write_direct(self, room: int, plan: _Plan, deadline: float) -> bool:
        """Same-host write by process_vm_writev; False when the kernel refuses it."""
        assert plan.peer is not None and plan.local_iov is not None
        assert plan.remote_iov is not None

        def check_deadline() -> None:
            if time.monotonic() >= deadline:
                raise TransportError(f"room {room}: deadline exceeded writing into {plan.name}")

        cma.check_alive(plan.peer, plan.name)
        try:
            cma.write_runs(
                plan.peer.pid, plan.local_iov, plan.remote_iov, plan.name, check_deadline
            )
        except cma.CMAError as exc:
            if exc.errno == errno.EPERM:
                self._no_cma.add(plan.endpoint)
                return False
            if exc.errno == errno.ESRCH:
                raise TransportError(f"room {room}: {plan.name} is gone (process exited)") from None
            raise TransportError(f"room {room}: {exc}") from None
        return True

    def _plan(self, room: int, src_indices: Any, targets: Sequence[Target]) -> list[_Plan]:
        """Validate everything and turn each target into per-layer put lists."""
        if not self._regions:
            raise LayoutError("write() before register_buffers()")
        local_pages = min(r.num_pages for r in self._regions)
        src = check_indices(src_indices, local_pages, f"room {room} source indices")
        plans = []
        for t in targets:
            name = _short_name(t.endpoint, t.layout)
            dst_raw = np.asarray(t.dst_indices)
            if dst_raw.size == 0:
                continue  # dummy receiver: nothing to send
            remote = self._check_layout(t.layout, name)
            remote_pages = min(int(b["num_pages"]) for b in remote)
            dst = check_indices(dst_raw, remote_pages, f"room {room} indices for {name}")
            check_unique(dst, f"room {room} indices for {name}")
            if dst.size != src.size:
                raise LayoutError(
                    f"room {room}: {src.size} source pages but {dst.size} destination pages "
                    f"for {name}"
                )
            runs = merge_runs(src, dst)
            ops = []
            nbytes = 0
            locals_, remotes, sizes = [], [], []
            for local, rb in zip(self._regions, remote, strict=True):
                pb = local.page_bytes
                lengths = runs.length * pb
                laddr = local.addr + runs.src * pb
                raddr = int(rb["addr"]) + runs.dst * pb
                locals_.append(laddr)
                remotes.append(raddr)
                sizes.append(lengths)
                ops.append((laddr.tolist(), raddr.tolist(), lengths.tolist()))
                nbytes += int(lengths.sum())
            plan = _Plan(t.endpoint, name, [bytes(b["rkey"]) for b in remote], ops, nbytes)
            peer = cma.Identity.from_dict(t.layout.get("id"))
            if (
                self.settings.cma
                and peer is not None
                and self._identity.same_host(peer)
                and t.endpoint not in self._no_cma
                and all(r.memory == "host" for r in self._regions)
                and all(b.get("memory") == "host" for b in remote)
            ):
                length = np.concatenate(sizes)
                plan.peer = peer
                plan.local_iov = cma.iovecs(np.concatenate(locals_), length)
                plan.remote_iov = cma.iovecs(np.concatenate(remotes), length)
            plans.append(plan)
        return plans

    def _check_layout(self, layout: dict[str, Any], name: str) -> list[dict[str, Any]]:
        if layout.get("transport") != "ucx" or layout.get("version") != LAYOUT_VERSION:
            raise LayoutError(
                f"{name}: layout is not a UCX layout version {LAYOUT_VERSION} "
                f"(transport={layout.get('transport')!r}, version={layout.get('version')!r})"
            )
        remote: list[dict[str, Any]] = list(layout.get("buffers") or [])
        if len(remote) != len(self._regions):
            raise LayoutError(
                f"{name} registered {len(remote)} buffers, this side {len(self._regions)}"
            )
        for i, (local, rb) in enumerate(zip(self._regions, remote, strict=True)):
            if int(rb["page_bytes"]) != local.page_bytes:
                raise LayoutError(
                    f"buffer {i}: page size {local.page_bytes} here but {rb['page_bytes']} "
                    f"at {name}"
                )
        return remote

    async def _peer(self, endpoint: bytes, name: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            ucxx = self._rt.ucxx
            try:
                address = ucxx.get_ucx_address_from_buffer(endpoint)
                ep = await ucxx.create_endpoint_from_worker_address(
                    address, endpoint_error_handling=self.settings.error_handling
                )
            except Exception as exc:  # ucxx raises its own exception types
                raise TransportError(f"cannot reach {name}: {exc}") from exc
            raced = self._peers.get(endpoint)
            if raced is not None:  # a concurrent write connected first: use its endpoint
                with contextlib.suppress(Exception):
                    ep.abort()
                return raced
            peer = _Peer(name, ep, int(ep.ucp_endpoint))
            self._peers[endpoint] = peer
        return peer

    def _rkey(self, peer: _Peer, packed: bytes) -> int:
        rkey = peer.rkeys.get(packed)
        if rkey is None:
            handle = ctypes.c_void_p()
            self._lib.check(
                self._lib.ep_rkey_unpack(peer.ep_h, packed, ctypes.byref(handle)),
                f"unpacking the remote key of {peer.name}",
            )
            rkey = handle.value or 0
            peer.rkeys[packed] = rkey
        return rkey

    def _drop_peer(self, endpoint: bytes) -> None:
        """Forget a peer after a failure so the next write reconnects from scratch."""
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        for rkey in peer.rkeys.values():
            self._lib.rkey_destroy(rkey)
        peer.rkeys.clear()
        with contextlib.suppress(Exception):
            peer.ep.abort()

    async def _write(self, room: int, plans: list[_Plan], deadline: float) -> None:
        lib = self._lib
        put, flush_nbx = lib.put_nbx, lib.ep_flush_nbx
        flush_param = _RequestParam()
        pending: list[tuple[int, _Plan]] = []
        try:
            for plan in plans:
                peer = await self._peer(plan.endpoint, plan.name)
                rkeys = [self._rkey(peer, packed) for packed in plan.rkeys]
                ep_h = peer.ep_h
                for region, rkey, (laddrs, raddrs, sizes) in zip(
                    self._regions, rkeys, plan.ops, strict=True
                ):
                    param = ctypes.byref(region.param)
                    for laddr, raddr, size in zip(laddrs, raddrs, sizes, strict=True):
                        ptr = put(ep_h, laddr, size, raddr, rkey, param)
                        if ptr:
                            status = _ptr_status(ptr)
                            if status < 0:
                                raise TransportError(
                                    f"room {room}: put to {plan.name} failed: "
                                    f"{lib.status_string(status)}{_PEER_HINT}"
                                )
                            pending.append((ptr, plan))
                # Remote completion of every put above, in one request per target.
                ptr = flush_nbx(ep_h, ctypes.byref(flush_param))
                status = _ptr_status(ptr)
                if status < 0:
                    raise TransportError(
                        f"room {room}: flush to {plan.name} failed: "
                        f"{lib.status_string(status)}{_PEER_HINT}"
                    )
                if status == _UCS_INPROGRESS:
                    pending.append((ptr or 0, plan))
            await self._wait(room, pending, deadline)
        except BaseException as exc:
            for ptr, _ in pending:
                lib.request_free(ptr)
            failed = (
                {p.endpoint for _, p in pending}
                if isinstance(exc, TimeoutError)
                else {p.endpoint for p in plans}
            )
            for endpoint in failed:
                self._drop_peer(endpoint)
            if isinstance(exc, TimeoutError):
                names = sorted({p.name for _, p in pending})
                raise TransportError(
                    f"room {room}: deadline exceeded with {len(pending)} operations to "
                    f"{', '.join(names)} unfinished (peer dead or unreachable?)"
                ) from None
            raise

    async def _wait(self, room: int, pending: list[tuple[int, _Plan]], deadline: float) -> None:
        """Progress the worker until every request completes; TimeoutError at the deadline.

        Only the last request of each target (its flush) is polled while waiting:
        polling hundreds of puts per progress call cost more than the copies.
        Completed requests are removed from ``pending`` in place, so the caller
        frees only what is still outstanding.
        """
        lib, worker = self._lib, self._rt.worker
        check = lib.request_check_status
        spins = 0
        while pending:
            worker.progress()
            if all(check(ptr) != _UCS_INPROGRESS for ptr in self._lasts(pending)):
                keep, error = [], None
                for ptr, plan in pending:
                    status = check(ptr)
                    if status == _UCS_INPROGRESS:
                        keep.append((ptr, plan))
                        continue
                    lib.request_free(ptr)
                    if status < 0 and error is None:
                        error = (
                            f"room {room}: transfer to {plan.name} failed: "
                            f"{lib.status_string(status)}{_PEER_HINT}"
                        )
                pending[:] = keep
                if error is not None:
                    raise TransportError(error)
                if not pending:
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError
            spins += 1
            # Spin briefly (transfers finish in micro- to milliseconds), then back off.
            await asyncio.sleep(0 if spins < 200 else 0.0005)

    @staticmethod
    def _lasts(pending: list[tuple[int, _Plan]]) -> list[int]:
        """The last outstanding request of each target (the flush, when it is pending)."""
        last: dict[int, int] = {}
        for ptr, plan in pending:
            last[id(plan)] = ptr
        return list(last.values())

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
        for endpoint in list(self._peers):
            self._drop_peer(endpoint)
        self._unmap(self._regions)
        self._regions = []

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def __enter__(self) -> UCXTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ucx_thread(coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
    """Run a ucxx coroutine on this process's UCX thread (for tools and benchmarks
    that drive ucxx directly next to a transport, with the same context and settings)."""
    return _Runtime.get(UCXSettings()).call(coro, timeout, "ucxx call")
