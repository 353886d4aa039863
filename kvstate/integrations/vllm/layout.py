"""Which bytes of vLLM's KV cache are one block's, as buffers kvstate's transport can
register (each a run of equal pages, page ``i`` = block ``i``).

vLLM 0.34 hands ``register_kv_caches`` one view per layer, ``[blocks, heads, tokens,
content]`` (K and V side by side in ``content``; MLA one latent), over one backing
allocation whose physical order ``VLLM_KV_CACHE_LAYOUT`` picks. Whatever the order, a
block's bytes are a few runs at a fixed stride from block to block:

- layer-outer layouts (LBHNC = HND, LBNHC = NHD): one run per layer;
- block-outer layouts (BLHNC, BLNHC, BHLNC): one run per block holding every layer;
- LHBNC (heads outside blocks): one run per layer and head.

Each view's shape and strides are checked against the ``KVCacheConfig`` (its block
count and page size) before anything registers, so a view kvstate would misread is
refused here, at start-up, never moved as wrong bytes. Both engines must use the same
layout and geometry: ``signature()`` travels with each request (see scheduler.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstate.errors import LayoutRefusedError

SUPPORTED = (
    "vLLM 0.34's per-layer [blocks, heads, tokens, content] views as "
    "vllm.v1.worker.utils.allocate_kv_cache makes them (any VLLM_KV_CACHE_LAYOUT: "
    "LBHNC/HND, LBNHC/NHD, LHBNC, BLHNC, BLNHC, BHLNC; attention or MLA), one KV cache "
    "group (--disable-hybrid-kv-cache-manager)"
)


@dataclass(frozen=True)
class Buffer:
    """One registered run: a 1-D uint8 tensor over the bytes of ``num_blocks`` pages."""

    tensor: Any
    page_bytes: int


@dataclass(frozen=True, eq=False)
class _View:
    """A view's block footprint: block ``b`` covers [ptr + b*stride, ptr + b*stride + hi)."""

    name: str
    storage: Any
    base: int  # address of the storage
    ptr: int
    stride: int
    hi: int
    dense: bool  # the page's bytes are exactly [ptr, ptr + hi)


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    """The KV cache layout vLLM resolved for this engine (KVCacheLayout's name)."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None) or getattr(
        kv_cache_config, "kv_cache_layout", None
    )
    return str(name or "unresolved")


def _spec(kv_cache_config: Any) -> Any:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise LayoutRefusedError(
            f"the KV cache has {len(groups)} groups (hybrid KV cache manager); kvstate "
            f"supports {SUPPORTED}"
        )
    spec = groups[0].kv_cache_spec
    if not getattr(spec, "has_layer_views", False) or not hasattr(spec, "num_heads"):
        raise LayoutRefusedError(
            f"KV cache spec {type(spec).__name__} has no per-layer attention views; "
            f"kvstate supports {SUPPORTED}"
        )
    return spec


def signature(vllm_config: Any, kv_cache_config: Any) -> str:
    """What must be equal on both engines for page ``i`` here to mean page ``i`` there:
    layout, spec kind, block geometry, dtype, layers and TP size."""
    spec = _spec(kv_cache_config)
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    tp = vllm_config.parallel_config.tensor_parallel_size
    dtype = str(getattr(spec, "dtype", "?")).replace("torch.", "")
    return (
        f"{layout_name(vllm_config, kv_cache_config)} {type(spec).__name__} "
        f"{layers} layers x {spec.block_size} tokens x {spec.num_heads} heads x "
        f"{spec.state_content_size_bytes} B ({dtype}), page {spec.page_size_bytes} B, TP {tp}"
    )


def buffers(kv_caches: Mapping[str, Any], kv_cache_config: Any, layout: str) -> list[Buffer]:
    """The runs to register, in a fixed order (layers as the KVCacheConfig lists
    them), or LayoutRefusedError naming the layout and what kvstate supports."""
    spec = _spec(kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    order = [n for t in kv_cache_config.kv_cache_tensors for n in t.layers]
    names = sorted(kv_caches, key=lambda n: (order.index(n) if n in order else len(order), n))
    views: list[_View] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name in names:
        t = kv_caches[name]
        key = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        if key in seen:  # a layer sharing another's cache (kv sharing): moved once
            continue
        seen.add(key)
        views += _footprints(name, _check(name, t, spec, num_blocks, layout), layout)
    runs = _runs(views, layout)
    _check_disjoint(runs, layout)
    return [_buffer(v, start, stride, num_blocks, layout) for v, start, stride in runs]


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
    subs = [t]
    for d in sorted(outer, reverse=True):
        subs = [s.select(d, i) for s in subs for i in range(t.shape[d])]
    out = []
    storage = t.untyped_storage()
    for s in subs:
        hi = e + sum((n - 1) * st * e for n, st in zip(s.shape[1:], s.stride()[1:], strict=True))
        if hi > stride:
            raise _refuse(name, layout, f"blocks overlap (block stride {stride} B, page {hi} B)")
        dense = s[0].numel() * e == hi
        out.append(_View(name, storage, storage.data_ptr(), s.data_ptr(), stride, hi, dense))
    return out


def _runs(views: list[_View], layout: str) -> list[tuple[_View, int, int]]:
    """(a view of the storage, first address, block stride) of each run. A dense view
    whose page fills its stride is a run of its own; views whose pages interleave
    within one stride (block-outer layouts) share the run that stride covers."""
    runs: list[tuple[_View, int, int]] = []
    loose = [v for v in views if not (v.dense and v.hi == v.stride)]
    runs += [(v, v.ptr, v.stride) for v in views if v.dense and v.hi == v.stride]
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
            runs.append((here[0], start, stride))
            members = [v for v in members if v.ptr >= start + stride]
    position = {id(v): i for i, v in enumerate(views)}
    return sorted(runs, key=lambda r: (position[id(r[0])], r[1]))


def _check_disjoint(runs: list[tuple[_View, int, int]], layout: str) -> None:
    spans = sorted((start, start + stride, v.name) for v, start, stride in runs)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise _refuse(b, layout, f"its bytes overlap those of layer {a}")


def _buffer(view: _View, start: int, stride: int, num_blocks: int, layout: str) -> Buffer:
    import torch

    nbytes = stride * num_blocks
    if start + nbytes > view.base + view.storage.nbytes():
        raise _refuse(view.name, layout, "its blocks run past the end of its allocation")
    flat = torch.empty(0, dtype=torch.uint8, device=view.storage.device)
    flat.set_(view.storage, start - view.base, (nbytes,), (1,))
    return Buffer(flat, stride)


__all__ = ["SUPPORTED", "Buffer", "LayoutRefusedError", "buffers", "layout_name", "signature"]
