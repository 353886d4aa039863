"""Which bytes of vLLM's KV cache are one block's, as buffers kvstate's transport can
register (each a run of equal pages, page ``i`` = block ``i``), and how each page splits
into KV heads.

vLLM 0.34 hands ``register_kv_caches`` one view per layer, ``[blocks, heads, tokens,
content]`` (K and V side by side in ``content``; MLA one latent), over one backing
allocation whose physical order ``VLLM_KV_CACHE_LAYOUT`` picks. Whatever the order, a
block's bytes are a few runs at a fixed stride from block to block:

- layer-outer layouts (LBHNC = HND, LBNHC = NHD): one run per layer;
- block-outer layouts (BLHNC, BLNHC, BHLNC): one run per block holding every layer;
- LHBNC (heads outside blocks): one run per layer and head.

Each view's shape and strides are checked against the ``KVCacheConfig`` (its block
count and page size) before anything registers, so a view kvstate would misread is
refused here, at start-up, never moved as wrong bytes. Each run also gets its
``Geometry``: its name (the layer, so that a pipeline stage's layers meet the decode's
by name) and its page as ``outer`` blocks of ``heads`` equal chunks, read from the
view's strides and checked byte by byte, which is what lets engines of different
tensor-parallel sizes move parts of pages (handoff.py decides when they may).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstate.errors import LayoutRefusedError
from kvstate.integrations.vllm.groups import groups_of, transfer_ids
from transports.base import Geometry

SUPPORTED = (
    "vLLM 0.34's per-layer [blocks, heads, tokens, content] views as "
    "vllm.v1.worker.utils.allocate_kv_cache makes them (any VLLM_KV_CACHE_LAYOUT: "
    "LBHNC/HND, LBNHC/NHD, LHBNC, BLHNC, BLNHC, BHLNC; attention or MLA), in KV cache "
    "groups of full attention, sliding window or Mamba state (groups.py)"
)


# Layouts whose every run holds whole heads side by side, so a page splits into KV
# heads (LHBNC keeps each head in a run of its own: a page is one head there).
SPLITS_HEADS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC")
BLOCK_OUTER = ("BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class Buffer:
    """One registered run: a 1-D uint8 tensor over the bytes of ``num_blocks`` pages,
    and what a page holds (``Geometry``: its name, how it splits into heads)."""

    tensor: Any
    page_bytes: int
    geometry: Geometry


@dataclass(frozen=True, eq=False)
class _View:
    """A view's block footprint: block ``b`` covers [ptr + b*stride, ptr + b*stride + hi).
    ``sub`` is the view itself ([blocks, ...]); its heads are dim ``head_dim``, or,
    when that dim was split off (heads outside blocks), it is head ``head`` alone."""

    name: str
    storage: Any
    base: int  # address of the storage
    ptr: int
    stride: int
    hi: int
    dense: bool  # the page's bytes are exactly [ptr, ptr + hi)
    sub: Any = None
    head_dim: int | None = None
    head: int = 0


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    """The KV cache layout vLLM resolved for this engine (KVCacheLayout's name)."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None) or getattr(
        kv_cache_config, "kv_cache_layout", None
    )
    return str(name or "unresolved")


def is_mla(spec: Any) -> bool:
    """An MLA latent cache (one latent per token, the same on every TP rank)."""
    return any(c.__name__ == "MLAAttentionSpec" for c in type(spec).__mro__)


def head_split(layout: str, spec: Any) -> str:
    """Why this engine's pages cannot be split by KV heads ('' when they can): what
    engines of different tensor-parallel sizes need unless each rank holds as many
    heads on both sides (MLA: the whole latent)."""
    if layout not in SPLITS_HEADS:
        return (
            f"KV cache layout {layout} keeps each KV head in a run of its own, so a page "
            f"cannot be split by heads (layouts that can: {', '.join(SPLITS_HEADS)})"
        )
    slots = getattr(spec, "num_head_slots", None)
    if slots is not None and slots != getattr(spec, "num_kv_heads", slots):
        return f"the KV cache packs {spec.num_kv_heads} KV heads into {slots} head slots"
    if getattr(spec, "page_size_padded", None):
        return "the KV cache pads its pages"
    return ""


def spec_of(kv_cache_config: Any) -> Any:
    """The attention spec of the engine's KV cache groups (every attention group's
    pages alike: heads, bytes, block size), or LayoutRefusedError. A group kvstate
    does not move (groups.py) refuses the engine here, at start-up."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    specs = [
        groups[i].kv_cache_spec
        for i, g in zip(transfer_ids(kv_cache_config), groups_of(kv_cache_config), strict=True)
        if g.kind != "state"
    ]
    if not specs or not all(
        getattr(s, "has_layer_views", False) and hasattr(s, "num_heads") for s in specs
    ):
        names = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise LayoutRefusedError(
            f"KV cache spec {names}: no attention group with per-layer views (a model "
            f"without attention layers); kvstate supports {SUPPORTED}"
        )
    shape = {_page_shape(s) for s in specs}
    if len(shape) != 1:
        raise LayoutRefusedError(
            f"the attention groups' pages differ ({sorted(shape)}: block size, KV heads, "
            f"bytes a head, page); kvstate supports {SUPPORTED}"
        )
    return specs[0]


def _page_shape(spec: Any) -> tuple[int, int, int, int]:
    return (
        int(spec.block_size),
        int(spec.num_heads),
        int(spec.num_states * spec.state_content_size_bytes),
        int(spec.page_size_bytes),
    )


def _state_views(kv_cache_config: Any, kv_caches: Mapping[str, Any], layout: str) -> list[_View]:
    """The per-block footprint of each state layer (Mamba): its page for block ``b`` at
    the KVCacheTensor's ``offset + l * layer_stride + b * block_stride`` in the backing
    allocation, one whole (padded) page a block."""
    groups = list(kv_cache_config.kv_cache_groups)
    state_layers = {
        name
        for i, g in zip(transfer_ids(kv_cache_config), groups_of(kv_cache_config), strict=True)
        if g.kind == "state"
        for name in groups[i].layer_names
    }
    page_of = {n: int(g.kv_cache_spec.page_size_bytes) for g in groups for n in g.layer_names}
    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            t = kv_caches.get(name)
            if name not in state_layers or t is None:
                continue
            if int(tensor.block_stride) != page_of[name]:
                raise _refuse(
                    name,
                    layout,
                    f"a state page of {page_of[name]} B at a block stride of "
                    f"{tensor.block_stride} B (a block-outer layout); kvstate moves state "
                    "groups with a layer-outer layout (LBHNC, LBNHC)",
                )
            storage = t.untyped_storage()
            base = storage.data_ptr()
            ptr = base + int(tensor.offset) + i * int(tensor.layer_stride)
            stride = int(tensor.block_stride)
            out.append(_View(name, storage, base, ptr, stride, stride, True, None, None, 0))
    return out


def buffers(kv_caches: Mapping[str, Any], kv_cache_config: Any, layout: str) -> list[Buffer]:
    """The runs to register, in a fixed order (layers as the KVCacheConfig lists
    them), each with its Geometry, or LayoutRefusedError naming the layout and what
    kvstate supports. A layout that splits pages by heads (``head_split``) whose pages
    here do not split into equal chunks of whole heads is refused too."""
    spec = spec_of(kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    order = [n for t in kv_cache_config.kv_cache_tensors for n in t.layers]
    names = sorted(kv_caches, key=lambda n: (order.index(n) if n in order else len(order), n))
    views: list[_View] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    states = _state_views(kv_cache_config, kv_caches, layout)
    stateful = {v.name for v in states}
    for name in names:
        if name in stateful:
            continue
        t = kv_caches[name]
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        if key in seen:  # a layer sharing another's cache (kv sharing): moved once
            continue
        seen.add(key)
        views += _footprints(name, _check(name, t, spec, num_blocks, layout), layout)
    runs = _runs(views, layout)
    # a state layer's pages lie where an attention layer's do (vLLM overlays the
    # groups' pages): they move with that run
    covered = {(start, stride) for _, start, stride in runs}
    for v in states:
        if (v.ptr, v.stride) not in covered:
            raise _refuse(
                v.name,
                layout,
                "its state pages lie where no attention layer's pages do; kvstate moves "
                "a state with the attention pages it overlays (as vLLM 0.34 lays them)",
            )
    _check_disjoint([(vs[0], start, stride) for vs, start, stride in runs], layout)
    mla = is_mla(spec)
    split = not mla and not head_split(layout, spec)
    out = []
    for vs, start, stride in runs:
        geometry = _geometry(vs, start, stride, mla)
        if geometry is None:
            if split:
                raise _refuse(
                    vs[0].name,
                    layout,
                    "its pages do not split into equal chunks of whole KV heads, which "
                    "engines of different tensor_parallel_size need",
                )
            geometry = Geometry(_name(vs))
        out.append(_buffer(vs[0], start, stride, num_blocks, layout, geometry))
    return out


def _refuse(name: str, layout: str, what: str) -> LayoutRefusedError:
    return LayoutRefusedError(
        f"KV cache layout {layout}, layer {name}: {what}; kvstate supports {SUPPORTED}"
    )


def _check(name: str, t: Any, spec: Any, num_blocks: int, layout: str) -> Any:
    """The view in manager blocks ([num_blocks, ...page dims]), after checking it
    against the KVCacheConfig."""
    if not hasattr(t, "untyped_storage") or not hasattr(t, "stride"):
        raise _refuse(name, layout, f"a {type(t).__name__}, not a torch tensor")
    shape = tuple(t.shape)
    if t.dim() != 4:
        raise _refuse(name, layout, f"a {t.dim()}-D cache of shape {shape}")
    if shape[0] != num_blocks:
        if shape[0] % num_blocks:  # kernel blocks split manager blocks evenly, or not at all
            raise _refuse(
                name, layout, f"{shape[0]} blocks in shape {shape}, the KVCacheConfig {num_blocks}"
            )
        t = t.unflatten(0, (num_blocks, -1))
    page = t[0].numel() * t.element_size()
    want = spec.num_heads * spec.num_states * spec.state_content_size_bytes
    if page != want or shape[1] != spec.num_heads:
        raise _refuse(
            name,
            layout,
            f"shape {shape} ({page} bytes a block), the KVCacheConfig's spec "
            f"{spec.num_heads} heads and {want} bytes a block",
        )
    if any(s < 0 for s in t.stride()):
        raise _refuse(name, layout, f"negative strides {t.stride()}")
    return t


def _footprints(name: str, t: Any, layout: str) -> list[_View]:
    """The view's per-block footprint; a view whose page spans more than a block
    stride (heads outside blocks) is split along those dims first."""
    e = t.element_size()
    stride = t.stride(0) * e
    outer = [d for d in range(1, t.dim()) if t.shape[d] > 1 and t.stride(d) * e >= stride]
    # [blocks, (kernel blocks,) heads, tokens, content]: (view, its heads dim or None
    # once split off, the head it then holds)
    subs: list[tuple[Any, int | None, int]] = [(t, t.dim() - 3, 0)]
    for d in sorted(outer, reverse=True):
        subs = [_select(s, hd, h, d, i) for s, hd, h in subs for i in range(t.shape[d])]
    out = []
    storage = t.untyped_storage()
    for s, hd, h in subs:
        hi = e + sum((n - 1) * st * e for n, st in zip(s.shape[1:], s.stride()[1:], strict=True))
        if hi > stride:
            raise _refuse(name, layout, f"blocks overlap (block stride {stride} B, page {hi} B)")
        dense = s[0].numel() * e == hi
        out.append(
            _View(name, storage, storage.data_ptr(), s.data_ptr(), stride, hi, dense, s, hd, h)
        )
    return out


def _select(t: Any, hd: int | None, h: int, d: int, i: int) -> tuple[Any, int | None, int]:
    """``t.select(d, i)`` and where its heads are now: dim ``hd`` moved down by one if
    ``d`` was before it, or gone (head ``i`` alone) if ``d`` was the heads dim."""
    if hd == d:
        return t.select(d, i), None, i
    return t.select(d, i), None if hd is None else hd - (d < hd), h


def _runs(views: list[_View], layout: str) -> list[tuple[list[_View], int, int]]:
    """(the views in it, first address, block stride) of each run. A dense view whose
    page fills its stride is a run of its own; views whose pages interleave within one
    stride (block-outer layouts) share the run that stride covers."""
    runs: list[tuple[list[_View], int, int]] = []
    loose = [v for v in views if not (v.dense and v.hi == v.stride)]
    runs += [([v], v.ptr, v.stride) for v in views if v.dense and v.hi == v.stride]
    loose.sort(key=lambda v: (v.base, v.stride, v.ptr))
    for (_, stride), group in itertools.groupby(loose, key=lambda v: (v.base, v.stride)):
        members = list(group)
        while members:
            start = members[0].ptr
            here = [v for v in members if v.ptr < start + stride]
            end = max(v.ptr + v.hi for v in here)
            if end - start > stride:
                raise _refuse(
                    here[-1].name, layout, f"pages of one block span {end - start} B > {stride} B"
                )
            runs.append((here, start, stride))
            members = [v for v in members if v.ptr >= start + stride]
    position = {id(v): i for i, v in enumerate(views)}
    for vs, _, _ in runs:
        vs.sort(key=lambda v: position[id(v)])
    return sorted(runs, key=lambda r: (position[id(r[0][0])], r[1]))


def _check_disjoint(runs: list[tuple[_View, int, int]], layout: str) -> None:
    spans = sorted((start, start + stride, v.name) for v, start, stride in runs)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise _refuse(b, layout, f"its bytes overlap those of layer {a}")


def _name(views: list[_View]) -> str:
    """A run's name: its layer (and head, when heads lie outside blocks), or the first
    and last of the layers a block-outer run holds."""
    v = views[0]
    if len(views) > 1:
        return f"{v.name}..{views[-1].name}"
    return v.name if v.head_dim is not None else f"{v.name}#h{v.head}"


def _geometry(views: list[_View], start: int, page: int, mla: bool) -> Geometry | None:
    """The run's page as ``outer`` blocks of ``heads`` equal chunks, one per head: the
    chunk read from the strides (what lies inside the heads dimension), then every
    byte of a page checked to belong to the head that split says (None if not). A
    page of one head (heads outside blocks) or an MLA latent is not split (heads 0)."""
    name = _name(views)
    if mla or any(v.head_dim is None for v in views):
        return Geometry(name)
    v0 = views[0]
    hd = v0.head_dim
    assert hd is not None
    e = v0.sub.element_size()
    heads = int(v0.sub.shape[hd])
    hs = v0.sub.stride(hd) * e
    inner = [d for d in range(1, v0.sub.dim()) if d != hd and v0.sub.stride(d) * e < hs]
    chunk = int(np.prod([v0.sub.shape[d] for d in inner], dtype=np.int64)) * e
    if len(views) > 1 and views[1].ptr - v0.ptr < hs:  # layers inside heads (BHLNC)
        chunk *= len(views)
    if chunk <= 0 or page % (heads * chunk):
        return None
    owner = np.full(page, -1, dtype=np.int32)
    for v in views:
        if v.head_dim != hd or v.sub.dim() != v0.sub.dim():
            return None
        offs = np.full((1,) * (v.sub.dim() - 1), v.ptr - start, dtype=np.int64)
        head = np.zeros_like(offs)
        for d in range(1, v.sub.dim()):
            shape = [1] * (v.sub.dim() - 1)
            shape[d - 1] = int(v.sub.shape[d])
            idx = np.arange(v.sub.shape[d], dtype=np.int64).reshape(shape)
            offs = offs + idx * v.sub.stride(d) * e
            if d == hd:
                head = head + idx
        offs, head = np.broadcast_arrays(offs, head)
        at = (offs.reshape(-1, 1) + np.arange(e)).ravel()
        if at.min() < 0 or at.max() >= page or (owner[at] >= 0).any():
            return None
        owner[at] = np.repeat(head.ravel(), e)
    outer = page // (heads * chunk)
    want = np.tile(np.repeat(np.arange(heads, dtype=np.int32), chunk), outer)
    if not np.array_equal(owner, want):
        return None
    return Geometry(name, heads, outer)


def _buffer(
    view: _View, start: int, stride: int, num_blocks: int, layout: str, geometry: Geometry
) -> Buffer:
    import torch

    nbytes = stride * num_blocks
    if start + nbytes > view.base + view.storage.nbytes():
        raise _refuse(view.name, layout, "its blocks run past the end of its allocation")
    flat = torch.empty(0, dtype=torch.uint8, device=view.storage.device)
    flat.set_(view.storage, start - view.base, (nbytes,), (1,))
    return Buffer(flat, stride, geometry)


__all__ = [
    "BLOCK_OUTER",
    "SPLITS_HEADS",
    "SUPPORTED",
    "Buffer",
    "LayoutRefusedError",
    "buffers",
    "head_split",
    "is_mla",
    "layout_name",
    "spec_of",
]
