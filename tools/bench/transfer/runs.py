"""A layout's merged runs as each system is given them: memoryviews (the socket),
descriptor rows (NIXL, Mooncake) and in-process copies (memcpy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.transfer.workload import Config
from transports.pages import merge_runs


def views(
    bufs: list[np.ndarray], cfg: Config, pages: np.ndarray, partner: np.ndarray
) -> list[memoryview]:
    """One memoryview per merged run and layer, in the order both sides use."""
    runs = merge_runs(pages, partner)
    pb = cfg.page_bytes
    return [
        memoryview(b[s * pb : (s + n) * pb].data)
        for b in bufs
        for s, n in zip(runs.src.tolist(), runs.length.tolist(), strict=True)
    ]


def descs(
    cfg: Config, bufs: list[np.ndarray], remote_addrs: list[int], src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(addr, len, dev) rows, one per run and layer: what NIXL and Mooncake are given."""
    runs = merge_runs(src, dst)
    pb = cfg.page_bytes
    local, remote = [], []
    for b, raddr in zip(bufs, remote_addrs, strict=True):
        n = runs.length * pb
        local.append(np.stack([int(b.ctypes.data) + runs.src * pb, n, np.zeros_like(n)], 1))
        remote.append(np.stack([raddr + runs.dst * pb, n, np.zeros_like(n)], 1))
    return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)


def copy_ops(
    cfg: Config, layouts: dict[str, Any], srcs: list[np.ndarray], dsts: list[np.ndarray]
) -> dict[str, Callable[[], None]]:
    """Per layout, an in-process copy of its merged runs from ``srcs`` into ``dsts``: the
    memcpy row timed in turn and the baseline timed alone copy the same way."""
    pb = cfg.page_bytes
    ops: dict[str, Callable[[], None]] = {}
    for name, (src, dst) in layouts.items():
        runs = merge_runs(src, dst)
        spans = list(
            zip(
                (runs.src * pb).tolist(),
                (runs.dst * pb).tolist(),
                (runs.length * pb).tolist(),
                strict=True,
            )
        )

        def copy(spans: list[tuple[int, int, int]] = spans) -> None:
            for s, d in zip(srcs, dsts, strict=True):
                for so, do, n in spans:
                    d[do : do + n] = s[so : so + n]

        ops[name] = copy
    return ops
