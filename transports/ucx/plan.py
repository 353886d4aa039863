"""Registered buffers, peers and transfer plans: everything validated before a byte moves."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports import cma
from transports.base import LayoutError, Target
from transports.pages import Runs, check_indices, check_unique, merge_runs
from transports.ucx.abi import RequestParam

LAYOUT_VERSION = 1


@dataclass
class Region:
    """One registered buffer (a layer or kind of KV cache)."""

    obj: Any  # keeps the caller's array alive while UCX has it mapped
    addr: int
    nbytes: int
    page_bytes: int
    num_pages: int
    memory: str  # "host" or "cuda"
    memh: int = 0
    rkey: bytes = b""
    param: RequestParam = field(default_factory=RequestParam)


@dataclass
class Peer:
    """An endpoint to a receiver's worker plus the remote keys unpacked on it."""

    name: str
    ep: Any  # ucxx Endpoint; keeps the UCP endpoint alive
    ep_h: int
    rkeys: dict[bytes, int] = field(default_factory=dict)


@dataclass
class Plan:
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


def buffer_info(obj: Any, what: str) -> tuple[int, int, str]:
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


def short_name(endpoint: bytes, layout: dict[str, Any]) -> str:
    """A readable peer name for error messages."""
    tag = hashlib.blake2b(endpoint, digest_size=4).hexdigest()
    pid, host = layout.get("pid"), layout.get("host")
    return f"peer {tag} (pid {pid} on {host})" if pid is not None else f"peer {tag}"


def make_plans(
    room: int,
    src_indices: Any,
    targets: Sequence[Target],
    regions: list[Region],
    cma_from: cma.Identity | None,
    no_cma: Collection[bytes],
    put_chunk: int = 0,
) -> list[Plan]:
    """Validate everything and turn each target into per-layer put lists.

    ``cma_from`` is this process's identity when same-host copies are allowed
    (None: every target goes through UCX); ``no_cma`` the endpoints where the
    kernel refused them. ``put_chunk`` (bytes, 0: no limit) cuts the UCX puts
    of host memory into pieces of at most that size (``UCXSettings.put_chunk``
    says why); the same-host iovecs keep whole runs.
    """
    if not regions:
        raise LayoutError("write() before register_buffers()")
    local_pages = min(r.num_pages for r in regions)
    src = check_indices(src_indices, local_pages, f"room {room} source indices")
    plans = []
    for t in targets:
        name = short_name(t.endpoint, t.layout)
        dst_raw = np.asarray(t.dst_indices)
        if dst_raw.size == 0:
            continue  # dummy receiver: nothing to send
        remote = check_layout(t.layout, regions, name)
        remote_pages = min(int(b["num_pages"]) for b in remote)
        dst = check_indices(dst_raw, remote_pages, f"room {room} indices for {name}")
        check_unique(dst, f"room {room} indices for {name}")
        if dst.size != src.size:
            raise LayoutError(
                f"room {room}: {src.size} source pages but {dst.size} destination pages for {name}"
            )
        plan, (locals_, remotes, sizes) = _plan_target(
            t.endpoint, name, regions, remote, merge_runs(src, dst), put_chunk
        )
        peer = cma.Identity.from_dict(t.layout.get("id"))
        if (
            cma_from is not None
            and peer is not None
            and cma_from.same_host(peer)
            and t.endpoint not in no_cma
            and all(r.memory == "host" for r in regions)
            and all(b.get("memory") == "host" for b in remote)
        ):
            length = np.concatenate(sizes)
            plan.peer = peer
            plan.local_iov = cma.iovecs(np.concatenate(locals_), length)
            plan.remote_iov = cma.iovecs(np.concatenate(remotes), length)
        plans.append(plan)
    return plans


def _plan_target(
    endpoint: bytes,
    name: str,
    regions: list[Region],
    remote: list[dict[str, Any]],
    runs: Runs,
    put_chunk: int = 0,
) -> tuple[Plan, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]]:
    """The plan for one target, and per layer its local and remote run addresses
    and run lengths as arrays (for the same-host path, whole runs)."""
    ops = []
    nbytes = 0
    locals_, remotes, sizes = [], [], []
    for local, rb in zip(regions, remote, strict=True):
        pb = local.page_bytes
        lengths = runs.length * pb
        laddr = local.addr + runs.src * pb
        raddr = int(rb["addr"]) + runs.dst * pb
        locals_.append(laddr)
        remotes.append(raddr)
        sizes.append(lengths)
        if put_chunk > 0 and local.memory == "host" and rb.get("memory", "host") == "host":
            op = split_spans(laddr, raddr, lengths, put_chunk)
        else:
            op = (laddr, raddr, lengths)
        ops.append((op[0].tolist(), op[1].tolist(), op[2].tolist()))
        nbytes += int(lengths.sum())
    plan = Plan(endpoint, name, [bytes(b["rkey"]) for b in remote], ops, nbytes)
    return plan, (locals_, remotes, sizes)


def split_spans(
    laddr: np.ndarray, raddr: np.ndarray, length: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same bytes as spans of at most ``chunk`` bytes, in order (int64 arrays)."""
    laddr, raddr, length = (np.asarray(a, dtype=np.int64) for a in (laddr, raddr, length))
    if length.size == 0 or int(length.max()) <= chunk:
        return laddr, raddr, length
    pieces = (length + chunk - 1) // chunk
    run = np.repeat(np.arange(length.size), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(int(pieces.sum()), dtype=np.int64) - first) * chunk
    return laddr[run] + offset, raddr[run] + offset, np.minimum(chunk, length[run] - offset)


def check_layout(layout: dict[str, Any], regions: list[Region], name: str) -> list[dict[str, Any]]:
    """The remote buffers of a UCX layout that matches ours, or LayoutError."""
    if layout.get("transport") != "ucx" or layout.get("version") != LAYOUT_VERSION:
        raise LayoutError(
            f"{name}: layout is not a UCX layout version {LAYOUT_VERSION} "
            f"(transport={layout.get('transport')!r}, version={layout.get('version')!r})"
        )
    remote: list[dict[str, Any]] = list(layout.get("buffers") or [])
    if len(remote) != len(regions):
        raise LayoutError(f"{name} registered {len(remote)} buffers, this side {len(regions)}")
    for i, (local, rb) in enumerate(zip(regions, remote, strict=True)):
        if int(rb["page_bytes"]) != local.page_bytes:
            raise LayoutError(
                f"buffer {i}: page size {local.page_bytes} here but {rb['page_bytes']} at {name}"
            )
    return remote
