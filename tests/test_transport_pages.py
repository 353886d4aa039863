"""Page index validation and run merging (pure numpy, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from transports.base import LayoutError, TransportError
from transports.pages import check_indices, check_unique, merge_runs

pytestmark = pytest.mark.timeout(30)


def test_merge_runs_needs_both_sides_contiguous() -> None:
    src = np.array([0, 1, 2, 10, 11, 12, 13, 20])
    dst = np.array([5, 6, 9, 10, 11, 30, 31, 0])
    runs = merge_runs(src, dst)
    # 2 -> 9 breaks the destination side, 2 -> 10 the source side
    assert runs.src.tolist() == [0, 2, 10, 12, 20]
    assert runs.dst.tolist() == [5, 9, 10, 30, 0]
    assert runs.length.tolist() == [2, 1, 2, 2, 1]
    assert runs.pages == len(src)


def test_merge_runs_keeps_every_pair() -> None:
    rng = np.random.default_rng(0)
    src = rng.permutation(500)[:300]
    dst = np.sort(rng.permutation(1000)[:300])
    runs = merge_runs(src, dst)
    pairs = [
        (s + i, d + i)
        for s, d, n in zip(runs.src, runs.dst, runs.length, strict=True)
        for i in range(n)
    ]
    assert pairs == list(zip(src.tolist(), dst.tolist(), strict=True))


def test_merge_runs_edge_cases() -> None:
    assert merge_runs(np.array([], dtype=np.int32), np.array([], dtype=np.int32)).pages == 0
    one = merge_runs(np.arange(4096), np.arange(100, 4196))
    assert one.length.tolist() == [4096] and one.dst.tolist() == [100]
    backwards = merge_runs(np.array([3, 2, 1]), np.array([0, 1, 2]))
    assert backwards.length.tolist() == [1, 1, 1]
    with pytest.raises(LayoutError, match="differ"):
        merge_runs(np.arange(3), np.arange(4))


@pytest.mark.parametrize(
    ("indices", "needle"),
    [
        (np.array([0, 1, 10]), "outside a buffer of 10 pages"),
        (np.array([-1, 2]), "negative"),
        (np.arange(4).reshape(2, 2), "1-D"),
        (np.array([0.0, 1.0]), "integer"),
        (np.array(["a"]), "integer"),
    ],
)
def test_check_indices_names_the_problem(indices: np.ndarray, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle) as info:
        check_indices(indices, 10, "room 5 destination indices")
    assert "room 5 destination indices" in str(info.value)
    assert isinstance(info.value, TransportError) and isinstance(info.value, ValueError)


def test_check_indices_accepts_any_integer_width() -> None:
    for dtype in (np.int8, np.uint16, np.int32, np.int64):
        out = check_indices(np.array([0, 9], dtype=dtype), 10, "x")
        assert out.dtype == np.int64 and out.tolist() == [0, 9]
    assert check_indices([], 10, "x").size == 0


def test_check_unique() -> None:
    check_unique(np.array([3, 1, 2]), "dst")
    with pytest.raises(LayoutError, match="page index 2 appears more than once"):
        check_unique(np.array([2, 1, 2]), "dst")
