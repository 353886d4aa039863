"""Same-host writes with ``process_vm_writev`` (cross memory attach), batched.

Why not UCX's own CMA lane: measured with UCX 1.21 here, UCX selects CMA only
for endpoints without error handling, and on such an endpoint a put into a
process that has died makes UCX abort the *sender* (``cma_ep.c`` logs the
failed ``process_vm_writev`` at fatal level). With error handling on, UCX falls
back to TCP on one host (0.2-0.3 GB/s for puts). So on one host the transport
issues the same system call itself: up to 1024 page runs per call, no per-run
Python cost, and a dead peer is an ``errno`` (ESRCH), not an abort.

A peer is addressed by pid; the layout also carries the boot id, the pid
namespace and the process start time, checked before every write so a
recycled pid is never written to.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports.base import TransportError

IOV_MAX = 1024  # Linux limit on iovecs per process_vm_writev call
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.process_vm_writev
_writev.restype = ctypes.c_ssize_t
_writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                    ctypes.c_ulong, ctypes.c_ulong]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class Identity:
    """Who this process is, precisely enough to find it again on the same host."""

    boot_id: str
    pid_ns: str
    pid: int
    start_time: int

    @classmethod
    def here(cls) -> Identity:
        pid = os.getpid()
        return cls(_read("/proc/sys/kernel/random/boot_id"), _pid_ns(), pid,
                   _start_time(pid) or 0)

    def as_dict(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "pid_ns": self.pid_ns, "pid": self.pid,
                "start_time": self.start_time}

    @classmethod
    def from_dict(cls, d: Any) -> Identity | None:
        if not isinstance(d, dict):
            return None
        try:
            return cls(str(d["boot_id"]), str(d["pid_ns"]), int(d["pid"]), int(d["start_time"]))
        except (KeyError, TypeError, ValueError):
            return None

    def same_host(self, other: Identity) -> bool:
        return bool(self.boot_id) and (self.boot_id, self.pid_ns) == (other.boot_id, other.pid_ns)


def allow_peers() -> None:
    """Let same-user processes write into this one where Yama restricts ptrace."""
    _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


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


def write_runs(pid: int, local: np.ndarray, remote: np.ndarray, name: str,
               deadline_check: Any = None) -> int:
    """Copy run ``i`` from ``local[i]`` to ``remote[i]`` in process ``pid``; return bytes.

    ``local`` and ``remote`` are iovec arrays of the same shape and lengths.
    ``deadline_check`` is called between system calls (it raises to stop).
    """
    total = 0
    n = local.shape[0]
    start = 0
    while start < n:
        stop = min(start + IOV_MAX, n)
        want = int(local[start:stop, 1].sum())
        got = _writev(pid, local[start:].ctypes.data, stop - start,
                      remote[start:].ctypes.data, stop - start, 0)
        if got < 0:
            err = ctypes.get_errno()
            reason = "process gone" if err == errno.ESRCH else os.strerror(err)
            raise CMAError(f"writing into {name} failed: {reason}", err)
        if got != want:
            # The kernel stops at the first fault: report it rather than retry blindly.
            raise CMAError(
                f"writing into {name} stopped after {total + got} bytes "
                "(destination memory no longer mapped?)", errno.EFAULT,
            )
        total += got
        start = stop
        if deadline_check is not None and start < n:
            deadline_check()
    return total
