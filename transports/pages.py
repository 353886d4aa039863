"""Page index checks and run merging, vectorised so 4096 pages cost microseconds.

Every transfer is expressed as runs: ``(src_start, dst_start, length)`` in pages,
maximal so that both the source and the destination pages of a run are
contiguous. One run becomes one memory operation per layer, so fewer runs mean
fewer per-operation costs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from transports.base import LayoutError


class Runs(NamedTuple):
    """Maximal runs of pages contiguous on both sides (int64 arrays, same length)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    @property
    def pages(self) -> int:
        return int(self.length.sum())


def check_indices(indices: Any, num_pages: int, what: str) -> np.ndarray:
    """Return ``indices`` as int64 after checking they address pages of a buffer.

    Accepts a 1-D array of integers (any width) that are all in
    ``[0, num_pages)``. ``what`` names the array in the error message.
    """
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise LayoutError(f"{what}: expected a 1-D index array, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise LayoutError(f"{what}: expected integer page indices, got dtype {arr.dtype}")
    lo = int(arr.min())
    hi = int(arr.max())
    if lo < 0:
        raise LayoutError(f"{what}: negative page index {lo}")
    if hi >= num_pages:
        raise LayoutError(f"{what}: page index {hi} outside a buffer of {num_pages} pages")
    return arr.astype(np.int64, copy=False)


def check_unique(indices: np.ndarray, what: str) -> None:
    """Refuse repeated destination pages: two writes to one page mean a caller bug."""
    if indices.size < 2:
        return
    ordered = np.sort(indices)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if dup.size:
        raise LayoutError(f"{what}: page index {int(dup[0])} appears more than once")


def merge_runs(src: np.ndarray, dst: np.ndarray) -> Runs:
    """Group page pairs into maximal runs contiguous in both ``src`` and ``dst``.

    Order is kept: pair ``i`` goes from ``src[i]`` to ``dst[i]``; a run breaks
    wherever either side does not step by exactly one page.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise LayoutError(f"source and destination index arrays differ: {src.shape} vs {dst.shape}")
    n = src.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return Runs(empty, empty.copy(), empty.copy())
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return Runs(src[starts], dst[starts], lengths.astype(np.int64))
