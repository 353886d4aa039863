"""Same-host writes with ``process_vm_writev`` (cross memory attach), batched.

Why not UCX's own CMA lane: measured with UCX 1.21 here, on an endpoint without
error handling a put into a process that has died makes UCX abort the *sender*
(``cma_ep.c`` logs the failed ``process_vm_writev`` at fatal level). With error
handling on, UCX keeps its cma lane only with an infinite rendezvous threshold
(``transports.ucx.settings``: kvstate passes one; with ucxx's 8192 it fell back
to TCP on one host, 0.2-1 GB/s for puts), and even then one UCX put per run is
slower than this module's batched calls over two threads. So on one host the
transport issues the same system call itself: up to 1024 page runs per call, no per-run
Python cost, and a dead peer is an ``errno`` (ESRCH), not an abort. A large
write is split by bytes over a few threads (``write_runs``): the kernel pins
and maps every 4 KiB page it copies, so one thread stayed near 0.4x an
in-process memcpy here, two reached it.

A peer is addressed by pid; the layout also carries the boot id, the pid
namespace and the process start time, checked before every write so a
recycled pid is never written to.

Who may write here: ``process_vm_writev`` needs ptrace rights over the
receiver. Under Yama ``ptrace_scope=1`` a sibling process has none unless the
receiver names it with ``prctl(PR_SET_PTRACER, pid)``, or everyone with
``PR_SET_PTRACER_ANY`` (which lets any process of the user ptrace the engine:
read its memory, keys and tokens included). That is an operator's choice, so
nothing is changed by default (``KVSTATE_CMA_PTRACER``, see
:func:`apply_ptracer`): where the kernel refuses, senders use UCX instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports.base import TransportError

log = logging.getLogger(__name__)

PTRACER_ENV = "KVSTATE_CMA_PTRACER"
IOV_MAX = 1024  # Linux limit on iovecs per process_vm_writev call
#: a write is split across threads only into parts of at least this many bytes
MIN_PART_BYTES = 4 << 20
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def _read(path: str) -> str:
    """A small /proc file's text ('' if it cannot be read). With os.read, not a text
    file object, which costs ~2x as much: every CMA write reads its peer's start time
    (``check_alive``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace").strip()


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _net_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


@dataclass(frozen=True)
class Identity:
    """Who this process is, precisely enough to find it again on the same host."""

    boot_id: str
    pid_ns: str
    pid: int
    start_time: int
    net_ns: str = ""  # '' from a peer that does not say (an older layout)

    @classmethod
    def here(cls) -> Identity:
        pid = os.getpid()
        return cls(
            _read("/proc/sys/kernel/random/boot_id"),
            _pid_ns(),
            pid,
            _start_time(pid) or 0,
            _net_ns(),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
            "pid": self.pid,
            "start_time": self.start_time,
            "net_ns": self.net_ns,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Identity | None:
        if not isinstance(d, dict):
            return None
        try:
            return cls(
                str(d["boot_id"]),
                str(d["pid_ns"]),
                int(d["pid"]),
                int(d["start_time"]),
                str(d.get("net_ns", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def same_host(self, other: Identity) -> bool:
        return bool(self.boot_id) and (self.boot_id, self.pid_ns) == (other.boot_id, other.pid_ns)

    def same_net(self, other: Identity) -> bool:
        """On this host and in this network namespace (UCX reaches such a peer by
        shared memory; another namespace, a container's or the benchmark's stand-in for
        another host, by its network)."""
        return self.same_host(other) and bool(self.net_ns) and self.net_ns == other.net_ns


class PtracerError(TransportError, ValueError):
    """``KVSTATE_CMA_PTRACER`` holds something other than ``off``, ``any`` or a pid."""


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope``; None where Yama is not active."""
    raw = _read("/proc/sys/kernel/yama/ptrace_scope")
    return int(raw) if raw.isdigit() else None


def parse_ptracer(raw: str | None) -> str | int:
    """``off`` (default: leave ptrace rights alone), ``any``, or one pid (> 0)."""
    value = (raw or "off").strip().lower()
    if value in ("", "off", "0", "no", "none"):
        return "off"
    if value == "any":
        return "any"
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise PtracerError(
        f"{PTRACER_ENV}={raw!r} is not understood: use 'off' (default), 'any' (any process "
        "of this user may ptrace this one, so same-host senders can write by CMA under Yama "
        "ptrace_scope=1) or the pid of the one sender process allowed to"
    )


_logged: set[str] = set()
_log_lock = threading.Lock()


def apply_ptracer(policy: str | int) -> str:
    """Apply the ptrace policy (``parse_ptracer``) and log once per process what was done.

    ``PR_SET_PTRACER`` names a single process (each call replaces the last), so
    a pid only fits a receiver written by exactly one sender; several senders
    need ``any`` or a ptrace scope of 0 (or CAP_SYS_PTRACE). Returns the message.
    """
    scope = ptrace_scope()
    where = "Yama inactive" if scope is None else f"Yama ptrace_scope={scope}"
    if policy == "off":
        msg = f"{PTRACER_ENV}=off: ptrace rights left as they are ({where})"
        if scope is not None and scope >= 1:
            msg += (
                "; same-host senders that the kernel refuses write through UCX instead "
                f"of CMA ({PTRACER_ENV}=any or a sender pid allows CMA)"
            )
    else:
        arg = _PR_SET_PTRACER_ANY if policy == "any" else int(policy)
        rc = _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(arg), 0, 0, 0)
        err = ctypes.get_errno() if rc != 0 else 0
        who = "any process of this user" if policy == "any" else f"process {policy}"
        if rc == 0:
            msg = (
                f"{PTRACER_ENV}={policy}: PR_SET_PTRACER set, {who} may ptrace this "
                f"process (and write into it by CMA) ({where})"
            )
        else:
            msg = (
                f"{PTRACER_ENV}={policy}: PR_SET_PTRACER for {who} refused: "
                f"{os.strerror(err)} ({where}; nothing to change without Yama)"
            )
    with _log_lock:
        if msg not in _logged:
            _logged.add(msg)
            log.info("%s", msg)
    return msg


def check_alive(peer: Identity, name: str) -> None:
    """Raise unless ``peer`` is still the process that published its layout."""
    st = _start_time(peer.pid)
    if st is None:
        raise TransportError(f"{name} is gone (no process {peer.pid})")
    if st != peer.start_time:
        raise TransportError(f"{name} is gone (pid {peer.pid} now belongs to another process)")


def iovecs(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """An array of ``struct iovec`` ({base, len}, two uint64 each) for the runs."""
    iov = np.empty((addr.size, 2), dtype=np.uint64)
    iov[:, 0] = addr
    iov[:, 1] = length
    return iov


class CMAError(TransportError):
    """``process_vm_writev`` failed; ``errno`` says why (EPERM: not permitted here)."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


def write_runs(
    pid: int,
    local: np.ndarray,
    remote: np.ndarray,
    name: str,
    deadline_check: Callable[[], None] | None = None,
    threads: int = 1,
    min_part: int = MIN_PART_BYTES,
) -> int:
    """Copy run ``i`` from ``local[i]`` to ``remote[i]`` in process ``pid``; return bytes.

    ``local`` and ``remote`` are iovec arrays of the same shape and lengths.
    ``deadline_check`` is called between system calls (it raises to stop).
    With ``threads`` > 1 the bytes are split into up to that many equal parts of
    at least ``min_part`` bytes, copied at once: the calling thread takes one,
    a shared pool the rest (the kernel pins and maps every page it copies, so
    one thread stays well below memcpy speed). Every part is finished before
    this returns or raises; the first error wins.
    """
    total = int(local[:, 1].sum()) if local.size else 0
    parts = max(1, min(threads, total // max(1, min_part)))
    if parts == 1:
        return _write_serial(pid, local, remote, name, deadline_check)
    pieces = split_iovecs(local, remote, parts)
    pool = _pool(parts - 1)
    futures = [
        pool.submit(_write_serial, pid, lo, ro, name, deadline_check) for lo, ro in pieces[1:]
    ]
    first: BaseException | None = None
    done = 0
    try:
        done += _write_serial(pid, pieces[0][0], pieces[0][1], name, deadline_check)
    except BaseException as exc:  # the other parts are still writing: wait for them first
        first = exc
    for fut in futures:
        try:
            done += fut.result()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
    return done


def split_iovecs(
    local: np.ndarray, remote: np.ndarray, parts: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The runs cut into ``parts`` pieces of equal bytes (a run may be cut in two)."""
    length = local[:, 1].astype(np.int64)
    ends = np.cumsum(length)
    starts = ends - length
    total = int(ends[-1])
    out = []
    for k in range(parts):
        lo, hi = total * k // parts, total * (k + 1) // parts
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))  # one past the last run
        lp, rp = local[first:last].copy(), remote[first:last].copy()
        front = lo - int(starts[first])
        back = int(ends[last - 1]) - hi
        lp[0, 0] += np.uint64(front)
        rp[0, 0] += np.uint64(front)
        lp[0, 1] -= np.uint64(front)
        lp[-1, 1] -= np.uint64(back)
        rp[:, 1] = lp[:, 1]
        out.append((lp, rp))
    return out


_pool_lock = threading.Lock()
_pool_obj: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's helper threads for split writes, grown to ``workers`` if needed."""
    global _pool_obj, _pool_size
    with _pool_lock:
        if _pool_obj is None or _pool_size < workers:
            old = _pool_obj
            _pool_obj = concurrent.futures.ThreadPoolExecutor(workers, "kvstate-cma")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool_obj


def _forget_pool() -> None:
    """In a forked child the pool's threads are gone while the object says they idle:
    start afresh rather than queue work nobody runs."""
    global _pool_obj, _pool_size
    _pool_obj, _pool_size = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _write_serial(
    pid: int,
    local: np.ndarray,
    remote: np.ndarray,
    name: str,
    deadline_check: Callable[[], None] | None = None,
) -> int:
    """``write_runs`` on this thread: up to IOV_MAX runs per system call."""
    total = 0
    n = local.shape[0]
    start = 0
    while start < n:
        stop = min(start + IOV_MAX, n)
        want = int(local[start:stop, 1].sum())
        got = _writev(
            pid,
            local[start:].ctypes.data,
            stop - start,
            remote[start:].ctypes.data,
            stop - start,
            0,
        )
        if got < 0:
            err = ctypes.get_errno()
            reason = "process gone" if err == errno.ESRCH else os.strerror(err)
            raise CMAError(f"writing into {name} failed: {reason}", err)
        if got != want:
            # The kernel stops at the first fault: report it rather than retry blindly.
            raise CMAError(
                f"writing into {name} stopped after {total + got} bytes "
                "(destination memory no longer mapped?)",
                errno.EFAULT,
            )
        total += got
        start = stop
        if deadline_check is not None and start < n:
            deadline_check()
    return total
