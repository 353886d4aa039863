"""Peers and transfer plans: everything validated before a byte moves."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from transports import cma
from transports.base import LayoutError, Target
from transports.pages import Runs, check_indices, check_unique, merge_runs
from transports.ucx.buffers import Region
from transports.ucx.pairing import Pairing, pairing_for


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
        pairing = pairing_for(t, regions, pairings)
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
