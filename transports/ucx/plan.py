"""Registered buffers, peers and transfer plans: everything validated before a byte moves."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports import cma
from transports.base import Geometry, Heads, LayoutError, Target
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
    geometry: Geometry = field(default_factory=Geometry)

    def describe(self) -> dict[str, Any]:
        """This buffer in the transport's layout (what a sender plans its writes by)."""
        out: dict[str, Any] = {
            "addr": self.addr,
            "nbytes": self.nbytes,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "memory": self.memory,
            "rkey": self.rkey,
        }
        g = self.geometry
        if g.name:
            out["name"] = g.name
        if g.heads:
            out["heads"], out["outer"] = g.heads, g.outer
        return out


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
    regions: list[Region]  # the local buffers written, one per entry of rkeys and ops
    rkeys: list[bytes]
    # per buffer: (local addresses, remote addresses, byte counts) as Python lists
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
    here: cma.Identity | None = None,
) -> list[Plan]:
    """Validate everything and turn each target into per-layer put lists.

    ``cma_from`` is this process's identity when same-host copies are allowed
    (None: every target goes through UCX); ``no_cma`` the endpoints where the
    kernel refused them. ``put_chunk`` (bytes, 0: no limit) cuts the UCX puts
    of host memory into pieces of at most that size (``UCXSettings.put_chunk``
    says why) for peers on another host; ``here`` is this process: to a peer on
    this host and network namespace UCX puts over cma, where whole runs are faster
    (``chunk_for``). The same-host iovecs keep whole runs.
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
        pairs = pair_buffers(t.layout, regions, name, t.buffers)
        remote_pages = min(int(b["num_pages"]) for _, b in pairs)
        dst = check_indices(dst_raw, remote_pages, f"room {room} indices for {name}")
        check_unique(dst, f"room {room} indices for {name}")
        if dst.size != src.size:
            raise LayoutError(
                f"room {room}: {src.size} source pages but {dst.size} destination pages for {name}"
            )
        peer = cma.Identity.from_dict(t.layout.get("id"))
        plan, (locals_, remotes, sizes) = _plan_target(
            t.endpoint, name, pairs, merge_runs(src, dst), t.heads, chunk_for(put_chunk, here, peer)
        )
        if (
            cma_from is not None
            and peer is not None
            and cma_from.same_host(peer)
            and t.endpoint not in no_cma
            and all(r.memory == "host" for r, _ in pairs)
            and all(b.get("memory") == "host" for _, b in pairs)
        ):
            length = np.concatenate(sizes)
            plan.peer = peer
            plan.local_iov = cma.iovecs(np.concatenate(locals_), length)
            plan.remote_iov = cma.iovecs(np.concatenate(remotes), length)
        plans.append(plan)
    return plans


def chunk_for(put_chunk: int, here: cma.Identity | None, peer: cma.Identity | None) -> int:
    """The put size limit for one peer: ``put_chunk`` (bytes, 0: none) for a peer on
    another host, or of unknown place; 0 for one on this host and network namespace,
    which UCX reaches over cma (zero-copy; one put per run beat 64 KiB puts there,
    ``UCXSettings.put_chunk``)."""
    if here is not None and peer is not None and here.same_net(peer):
        return 0
    return put_chunk


@dataclass(frozen=True)
class _Cut:
    """The bytes of ``heads`` in each page: ``outer`` segments of ``seg`` bytes, at
    ``src``/``dst`` in blocks of ``src_block``/``dst_block`` bytes."""

    src: int
    dst: int
    seg: int
    outer: int
    src_block: int
    dst_block: int


def _cut(local: Region, remote: dict[str, Any], heads: Heads | None, what: str) -> _Cut | None:
    """Where ``heads`` lie in a page on either side (None: the whole page moves)."""
    if heads is None:
        return None
    lh, rh = local.geometry.heads, int(remote.get("heads", 0))
    if lh == 0 and rh == 0:  # not split by heads (an MLA latent, a state slot)
        return None
    outer, router = local.geometry.outer, int(remote.get("outer", 1))
    rpb = int(remote["page_bytes"])
    if (
        lh == 0
        or rh == 0
        or outer != router
        or local.page_bytes % (outer * lh)
        or rpb % (outer * rh)
    ):
        raise LayoutError(
            f"{what}: pages split into {outer} x {lh} heads here, {router} x {rh} there: "
            "a part of a page can move only between like layouts (the same tokens per page "
            "and bytes per head, heads outermost or innermost alike on both sides)"
        )
    chunk = local.page_bytes // (outer * lh)
    if rpb // (outer * rh) != chunk:
        raise LayoutError(
            f"{what}: {chunk} bytes per head a block here, {rpb // (outer * rh)} there"
        )
    if not (heads.src >= 0 and heads.dst >= 0 and heads.count > 0) or (
        heads.src + heads.count > lh or heads.dst + heads.count > rh
    ):
        raise LayoutError(
            f"{what}: heads {heads.src}..{heads.src + heads.count - 1} into "
            f"{heads.dst}..{heads.dst + heads.count - 1}, but the pages hold {lh} heads here "
            f"and {rh} there"
        )
    if heads.src == heads.dst == 0 and heads.count == lh == rh:
        return None
    return _Cut(
        heads.src * chunk, heads.dst * chunk, heads.count * chunk, outer, lh * chunk, rh * chunk
    )


def _plan_target(
    endpoint: bytes,
    name: str,
    pairs: list[tuple[Region, dict[str, Any]]],
    runs: Runs,
    heads: Heads | None = None,
    put_chunk: int = 0,
) -> tuple[Plan, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]]:
    """The plan for one target, and per buffer its local and remote span addresses
    and span lengths as arrays (for the same-host path, whole spans): a run of whole
    pages is one span; with ``heads``, each page is ``outer`` spans of those heads."""
    ops = []
    nbytes = 0
    locals_, remotes, sizes = [], [], []
    for i, (local, rb) in enumerate(pairs):
        pb, rpb = local.page_bytes, int(rb["page_bytes"])
        what = f"buffer {local.geometry.name or i} of {name}"
        cut = _cut(local, rb, heads, what)
        if cut is None:
            if rpb != pb:
                raise LayoutError(f"{what}: page size {pb} here but {rpb} there")
            lengths = runs.length * pb
            laddr = local.addr + runs.src * pb
            raddr = int(rb["addr"]) + runs.dst * rpb
        else:
            first = np.repeat(runs.src - np.cumsum(runs.length) + runs.length, runs.length)
            step = np.arange(runs.pages, dtype=np.int64)
            src_pages = first + step
            dst_pages = np.repeat(runs.dst - runs.src, runs.length) + src_pages
            blocks = np.arange(cut.outer, dtype=np.int64)
            laddr = (
                local.addr + cut.src + (src_pages[:, None] * pb + blocks * cut.src_block)
            ).ravel()
            raddr = (
                int(rb["addr"]) + cut.dst + (dst_pages[:, None] * rpb + blocks * cut.dst_block)
            ).ravel()
            lengths = np.full(laddr.size, cut.seg, dtype=np.int64)
        locals_.append(laddr)
        remotes.append(raddr)
        sizes.append(lengths)
        if put_chunk > 0 and local.memory == "host" and rb.get("memory", "host") == "host":
            op = split_spans(laddr, raddr, lengths, put_chunk)
        else:
            op = (laddr, raddr, lengths)
        ops.append((op[0].tolist(), op[1].tolist(), op[2].tolist()))
        nbytes += int(lengths.sum())
    regions = [r for r, _ in pairs]
    plan = Plan(endpoint, name, regions, [bytes(b["rkey"]) for _, b in pairs], ops, nbytes)
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


def pair_buffers(
    layout: dict[str, Any],
    regions: list[Region],
    name: str,
    only: tuple[str, ...] | None = None,
) -> list[tuple[Region, dict[str, Any]]]:
    """Each local buffer to write (those named in ``only``, else all) with the remote
    buffer it goes into: by name when both sides name every buffer (a pipeline stage
    holds some of the receiver's layers), else by position (the same count on both
    sides). LayoutError when the layouts do not fit."""
    if layout.get("transport") != "ucx" or layout.get("version") != LAYOUT_VERSION:
        raise LayoutError(
            f"{name}: layout is not a UCX layout version {LAYOUT_VERSION} "
            f"(transport={layout.get('transport')!r}, version={layout.get('version')!r})"
        )
    remote: list[dict[str, Any]] = list(layout.get("buffers") or [])
    local = regions if only is None else [r for r in regions if r.geometry.name in only]
    if only is not None and len(local) != len(set(only)):
        missing = sorted(set(only) - {r.geometry.name for r in regions})
        raise LayoutError(f"no buffer named {missing} registered here (writing to {name})")
    if all(r.geometry.name for r in regions) and remote and all(b.get("name") for b in remote):
        by_name = {str(b["name"]): b for b in remote}
        gone = [r.geometry.name for r in local if r.geometry.name not in by_name]
        if gone:
            raise LayoutError(f"{name} registered no buffer named {gone}")
        return [(r, by_name[r.geometry.name]) for r in local]
    if only is not None:
        raise LayoutError(f"writing some buffers to {name} needs named buffers on both sides")
    if len(remote) != len(regions):
        raise LayoutError(f"{name} registered {len(remote)} buffers, this side {len(regions)}")
    return list(zip(regions, remote, strict=True))
