"""A sender's buffers paired with one receiver's: matched by name or position, their
page sizes and head cuts checked, grouped by how their pages split. Made once per
receiver layout (``pairing_for``), so a room's plan (``transports.ucx.plan``) costs a few
array operations per group, not per buffer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports import cma
from transports.base import Heads, LayoutError, Target
from transports.pages import Runs
from transports.ucx.buffers import Region

LAYOUT_VERSION = 1


def short_name(endpoint: bytes, layout: dict[str, Any]) -> str:
    """A readable peer name for error messages."""
    tag = hashlib.blake2b(endpoint, digest_size=4).hexdigest()
    pid, host = layout.get("pid"), layout.get("host")
    return f"peer {tag} (pid {pid} on {host})" if pid is not None else f"peer {tag}"


@dataclass(frozen=True)
class Cut:
    """The bytes of ``heads`` in each page: ``outer`` segments of ``seg`` bytes, at
    ``src``/``dst`` in blocks of ``src_block``/``dst_block`` bytes."""

    src: int
    dst: int
    seg: int
    outer: int
    src_block: int
    dst_block: int


def cut_of(local: Region, remote: dict[str, Any], heads: Heads | None, what: str) -> Cut | None:
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
    return Cut(
        heads.src * chunk, heads.dst * chunk, heads.count * chunk, outer, lh * chunk, rh * chunk
    )


@dataclass(frozen=True)
class Group:
    """Buffers whose pages split alike (page sizes, heads written, memory kinds): the
    same spans in each page, each buffer at its own base address."""

    lbase: np.ndarray  # local base addresses, one per buffer (int64)
    rbase: np.ndarray  # the remote buffers' base addresses
    pb: int  # local page bytes
    rpb: int  # remote page bytes
    cut: Cut | None
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
    paired and checked (``pair_buffers``, ``cut_of``), in group order (a model's layers
    are one group)."""

    layout: dict[str, Any]  # the layout it was made from (``pairing_for`` checks it is)
    source: list[Region]  # the transport's buffers it was made from (likewise)
    name: str
    regions: list[Region]
    rkeys: list[bytes]
    groups: list[Group]
    remote_pages: int
    peer: cma.Identity | None
    host: bool  # every buffer host memory on both sides: the same-host copy may apply


def make_pairing(t: Target, regions: list[Region]) -> Pairing:
    """``t``'s Pairing with these local buffers; LayoutError where they do not fit."""
    name = short_name(t.endpoint, t.layout)
    pairs = pair_buffers(t.layout, regions, name, t.buffers)
    members: dict[tuple[int, int, Cut | None, bool], list[tuple[Region, dict[str, Any]]]] = {}
    for i, (local, rb) in enumerate(pairs):
        pb, rpb = local.page_bytes, int(rb["page_bytes"])
        what = f"buffer {local.geometry.name or i} of {name}"
        cut = cut_of(local, rb, t.heads, what)
        if cut is None and rpb != pb:
            raise LayoutError(f"{what}: page size {pb} here but {rpb} there")
        host = local.memory == "host" and rb.get("memory", "host") == "host"
        members.setdefault((pb, rpb, cut, host), []).append((local, rb))
    ordered = [pair for group in members.values() for pair in group]
    groups = [
        Group(
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


KEPT = 1024  # pairings kept at most (receivers x head layouts), then made again


def pairing_for(
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
        if len(kept) >= KEPT:
            kept.clear()
        kept[key] = made
    return made


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
