"""Registered buffers, peers and transfer plans: everything validated before a byte moves."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
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


#: spans in a group of buffers: local addresses, remote addresses, lengths (buffers x spans)
_Spans = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Plan:
    """Everything one target needs, computed and validated before any byte moves."""

    endpoint: bytes
    pairing: Pairing
    spans: list[_Spans]  # one per group of ``pairing``
    nbytes: int
    put_chunk: int = 0  # UCX puts of host memory cut to this size (0: whole spans)
    # same-host peer reachable by process_vm_writev: its identity and iovec arrays
    peer: cma.Identity | None = None
    local_iov: np.ndarray | None = None
    remote_iov: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.pairing.name

    @property
    def regions(self) -> list[Region]:
        """The local buffers written, one per entry of ``rkeys`` and ``ops``."""
        return self.pairing.regions

    @property
    def rkeys(self) -> list[bytes]:
        return self.pairing.rkeys

    @cached_property
    def ops(self) -> list[tuple[list[int], list[int], list[int]]]:
        """Per buffer: the UCX puts' local addresses, remote addresses and byte counts,
        as Python lists (made only for a write through UCX)."""
        ops: list[tuple[list[int], list[int], list[int]]] = []
        for g, (laddr, raddr, length) in zip(self.pairing.groups, self.spans, strict=True):
            sizes = length[0]  # the same in every buffer of the group
            if self.put_chunk > 0 and g.host and sizes.size and int(sizes.max()) > self.put_chunk:
                for la, ra in zip(laddr, raddr, strict=True):
                    lo, ro, n = split_spans(la, ra, sizes, self.put_chunk)
                    ops.append((lo.tolist(), ro.tolist(), n.tolist()))
            else:
                each = sizes.tolist()  # shared by the group's buffers: puts only read it
                ops += [
                    (la, ra, each) for la, ra in zip(laddr.tolist(), raddr.tolist(), strict=True)
                ]
        return ops

    def iovecs(self) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote ``struct iovec`` arrays of every span (the same-host path)."""
        length = np.concatenate([n.ravel() for _, _, n in self.spans])
        local = np.concatenate([a.ravel() for a, _, _ in self.spans])
        remote = np.concatenate([a.ravel() for _, a, _ in self.spans])
        return cma.iovecs(local, length), cma.iovecs(remote, length)


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
    pairings: dict[tuple[Any, ...], Pairing] | None = None,
) -> list[Plan]:
    """Validate everything and turn each target into per-layer put lists.

    ``cma_from`` is this process's identity when same-host copies are allowed
    (None: every target goes through UCX); ``no_cma`` the endpoints where the
    kernel refused them. ``put_chunk`` (bytes, 0: no limit) cuts the UCX puts
    of host memory into pieces of at most that size (``UCXSettings.put_chunk``
    says why) for peers on another host; ``here`` is this process: to a peer on
    this host and network namespace UCX puts over cma, where whole runs are faster
    (``chunk_for``). The same-host iovecs keep whole runs. ``pairings``: where each
    target's ``Pairing`` is kept between calls (the transport's; None: none kept).
    """
    if not regions:
        raise LayoutError("write() before register_buffers()")
    local_pages = min(r.num_pages for r in regions)
    src = check_indices(src_indices, local_pages, f"room {room} source indices")
    plans = []
    for t in targets:
        dst_raw = np.asarray(t.dst_indices)
        if dst_raw.size == 0:
            continue  # dummy receiver: nothing to send
        pairing = _pairing_for(t, regions, pairings)
        name = pairing.name
        dst = check_indices(dst_raw, pairing.remote_pages, f"room {room} indices for {name}")
        check_unique(dst, f"room {room} indices for {name}")
        if dst.size != src.size:
            raise LayoutError(
                f"room {room}: {src.size} source pages but {dst.size} destination pages for {name}"
            )
        peer = pairing.peer
        plan = _plan_target(
            t.endpoint, pairing, merge_runs(src, dst), chunk_for(put_chunk, here, peer)
        )
        if (
            cma_from is not None
            and peer is not None
            and cma_from.same_host(peer)
            and t.endpoint not in no_cma
            and pairing.host
        ):
            plan.peer = peer
            plan.local_iov, plan.remote_iov = plan.iovecs()
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


@dataclass(frozen=True)
class _Group:
    """Buffers whose pages split alike (page sizes, heads written, memory kinds): the
    same spans in each page, each buffer at its own base address."""

    lbase: np.ndarray  # local base addresses, one per buffer (int64)
    rbase: np.ndarray  # the remote buffers' base addresses
    pb: int  # local page bytes
    rpb: int  # remote page bytes
    cut: _Cut | None
    host: bool  # host memory on both sides: UCX puts of it may be cut (put_chunk)

    def offsets(self, runs: Runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The spans of ``runs`` in one buffer: local and remote offsets, lengths: a run
        of whole pages is one span; with a cut, each page is ``outer`` spans of those
        heads."""
        if self.cut is None:
            return runs.src * self.pb, runs.dst * self.rpb, runs.length * self.pb
        cut = self.cut
        first = np.repeat(runs.src - np.cumsum(runs.length) + runs.length, runs.length)
        src_pages = first + np.arange(runs.pages, dtype=np.int64)
        dst_pages = np.repeat(runs.dst - runs.src, runs.length) + src_pages
        blocks = np.arange(cut.outer, dtype=np.int64)
        loff = (cut.src + (src_pages[:, None] * self.pb + blocks * cut.src_block)).ravel()
        roff = (cut.dst + (dst_pages[:, None] * self.rpb + blocks * cut.dst_block)).ravel()
        return loff, roff, np.full(loff.size, cut.seg, dtype=np.int64)


@dataclass(frozen=True)
class Pairing:
    """What writing to one receiver's layout takes whatever the pages: the buffers
    paired and checked (``pair_buffers``, ``_cut``), grouped by how their pages split,
    in group order. Made once per target layout: a room then costs a few array
    operations per group, not per buffer (a model's layers are one group)."""

    layout: dict[str, Any]  # the layout it was made from (``_pairing_for`` checks it is)
    source: list[Region]  # the transport's buffers it was made from (likewise)
    name: str
    regions: list[Region]
    rkeys: list[bytes]
    groups: list[_Group]
    remote_pages: int
    peer: cma.Identity | None
    host: bool  # every buffer host memory on both sides: the same-host copy may apply


def make_pairing(t: Target, regions: list[Region]) -> Pairing:
    """``t``'s Pairing with these local buffers; LayoutError where they do not fit."""
    name = short_name(t.endpoint, t.layout)
    pairs = pair_buffers(t.layout, regions, name, t.buffers)
    members: dict[tuple[int, int, _Cut | None, bool], list[tuple[Region, dict[str, Any]]]] = {}
    for i, (local, rb) in enumerate(pairs):
        pb, rpb = local.page_bytes, int(rb["page_bytes"])
        what = f"buffer {local.geometry.name or i} of {name}"
        cut = _cut(local, rb, t.heads, what)
        if cut is None and rpb != pb:
            raise LayoutError(f"{what}: page size {pb} here but {rpb} there")
        host = local.memory == "host" and rb.get("memory", "host") == "host"
        members.setdefault((pb, rpb, cut, host), []).append((local, rb))
    ordered = [pair for group in members.values() for pair in group]
    groups = [
        _Group(
            np.array([r.addr for r, _ in group], dtype=np.int64),
            np.array([int(b["addr"]) for _, b in group], dtype=np.int64),
            *key,
        )
        for key, group in members.items()
    ]
    return Pairing(
        t.layout,
        regions,
        name,
        [r for r, _ in ordered],
        [bytes(b["rkey"]) for _, b in ordered],
        groups,
        min(int(b["num_pages"]) for _, b in pairs),
        cma.Identity.from_dict(t.layout.get("id")),
        all(r.memory == "host" and b.get("memory") == "host" for r, b in pairs),
    )


_PAIRINGS = 1024  # pairings kept at most (receivers x head layouts), then made again


def _pairing_for(
    t: Target, regions: list[Region], kept: dict[tuple[Any, ...], Pairing] | None
) -> Pairing:
    """``t``'s Pairing, from ``kept`` when made from the same layout and buffers (the
    objects themselves: a receiver's layout is read once per incarnation and not
    changed; a registration replaces the transport's list of buffers)."""
    key = (t.endpoint, t.heads, t.buffers)
    if kept is not None:
        found = kept.get(key)
        if found is not None and found.layout is t.layout and found.source is regions:
            return found
    made = make_pairing(t, regions)
    if kept is not None:
        if len(kept) >= _PAIRINGS:
            kept.clear()
        kept[key] = made
    return made


def _plan_target(endpoint: bytes, pairing: Pairing, runs: Runs, put_chunk: int = 0) -> Plan:
    """The plan for one target: per group, the spans of ``runs`` in each buffer."""
    spans: list[_Spans] = []
    nbytes = 0
    for g in pairing.groups:
        loff, roff, length = g.offsets(runs)
        laddr, raddr = g.lbase[:, None] + loff, g.rbase[:, None] + roff
        spans.append((laddr, raddr, np.broadcast_to(length, laddr.shape)))
        nbytes += int(length.sum()) * g.lbase.size
    return Plan(endpoint, pairing, spans, nbytes, put_chunk)


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
