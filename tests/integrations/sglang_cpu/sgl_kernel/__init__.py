"""Test-only stand-in for the two ``sgl_kernel`` ops SGLang's CPU engine imports.

Only sgl-kernel's CPU build has ``assign_req_to_token_pool_cpu`` and
``copy_all_layer_kv_cache_cpu``, and that build is not on PyPI. The SGLang end-to-end
tests put this directory on the servers' ``PYTHONPATH`` only on a host without a GPU
and without any ``sgl_kernel``; a GPU host runs SGLang's own kernels. Plain torch and
ctypes, slow but exact: the tests' model is tiny.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``start..end`` of request
    i, gets the next ``end - start`` entries of ``out_cache_loc`` (requests in order)."""
    del pool_len  # the row length; torch indexing knows it
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """In every K/V buffer (base address ``data_ptrs[b]``, ``strides[b]`` bytes a slot),
    slot ``tgt_loc[i]`` becomes a copy of slot ``src_loc[i]``; all sources of a buffer
    are read before any target is written, so overlapping lists are safe."""
    targets, sources = tgt_loc.tolist(), src_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in sources]
        for t, row in zip(targets, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def __getattr__(name: str) -> object:
    """The CPU build's other ``*_cpu`` ops (speculative decoding's) are imported at
    module load but never called by these tests: a stand-in that says so if called."""
    if not name.endswith("_cpu"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: not in the tests' CPU stand-in")

    return missing
