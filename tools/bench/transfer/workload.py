"""The bytes moved and how they are checked: pages per layer, the two layouts, digests."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Config:
    layers: int = 4
    pages: int = 1024  # per layer
    page_bytes: int = 16384
    reps: int = 5
    warmup: int = 2

    @property
    def total_bytes(self) -> int:
        return self.layers * self.pages * self.page_bytes


def sender_layer(cfg: Config, layer: int) -> np.ndarray:
    rng = np.random.default_rng(1234 + layer)
    return rng.integers(0, 256, size=cfg.pages * cfg.page_bytes, dtype=np.uint8)


def runs_layout(n: int, run_min: int, run_max: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """All ``n`` pages cut into runs of run_min..run_max pages, placed in independent
    random orders on the source and the destination side."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < n:
        lens.append(min(int(rng.integers(run_min, run_max + 1)), n - sum(lens)))

    def place() -> np.ndarray:
        order = rng.permutation(len(lens))
        pos = np.empty(len(lens), dtype=np.int64)
        pos[order] = np.concatenate(([0], np.cumsum([lens[k] for k in order])[:-1]))
        return np.concatenate([np.arange(pos[k], pos[k] + lens[k]) for k in range(len(lens))])

    return place().astype(np.int32), place().astype(np.int32)


def digests(bufs: list[np.ndarray]) -> list[str]:
    return [hashlib.sha256(b.data).hexdigest() for b in bufs]


def expected_digests(cfg: Config, src: np.ndarray, dst: np.ndarray) -> list[str]:
    out = []
    for layer in range(cfg.layers):
        s = sender_layer(cfg, layer).reshape(cfg.pages, cfg.page_bytes)
        d = np.zeros_like(s)
        d[dst] = s[src]
        out.append(hashlib.sha256(d.data).hexdigest())
    return out


def rss_mib() -> float:
    """This process's resident memory (VmRSS), for the cost of UCX's buffers."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def layouts(cfg: Config) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(source pages, destination pages) of each case: contiguous, and fragmented into
    runs of 1-8 pages at random places on both sides (the same seed every run)."""
    ident = np.arange(cfg.pages, dtype=np.int32)
    return {"contiguous": (ident, ident), "fragmented": runs_layout(cfg.pages, 1, 8, 42)}
