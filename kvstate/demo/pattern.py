"""The bytes a room must carry, and the KV pools they are written into and checked in.

The pattern is derived from (room, page, layer) alone, so the decode side can check
every byte it received without being told what was sent."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import numpy as np

from kvstate.demo.messages import WorkerConfig
from kvstate.errors import KVStateError

__all__ = ["Pool", "cuda_backend", "expected_pages"]

_MASK = (1 << 64) - 1


def expected_pages(room: int, pages: np.ndarray, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes of logical pages ``pages`` of ``room`` in ``layer``: (n, page_bytes) uint8.

    Every 8-byte word differs within a page and between pages, layers and rooms, so
    a page written to the wrong place, shifted, or left stale fails the check."""
    words = page_bytes // 8
    base = (room * 0x9E3779B97F4A7C15 + (layer + 1) * 0xBF58476D1CE4E5B9) & _MASK
    seeds = np.uint64(base) + np.asarray(pages, dtype=np.uint64) * np.uint64(0x94D049BB133111EB)
    ramp = np.arange(words, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
    out = seeds[:, None] ^ ramp[None, :]
    return out.view(np.uint8).reshape(len(seeds), page_bytes)


class Pool:
    """One engine's KV cache: ``layers`` arrays of ``pool_pages`` pages, host or GPU, and
    a free list. Pages are handed out from the front and returned to the back, so the
    indices of later requests are fragmented the way a real allocator's are."""

    def __init__(self, cfg: WorkerConfig, seed: int) -> None:
        self.cfg = cfg
        self.backend = cuda_backend() if cfg.device == "cuda" else "numpy"
        shape = (cfg.pool_pages, cfg.page_bytes)
        self.layers: list[Any]
        if self.backend == "cupy":
            import cupy

            self.layers = [cupy.zeros(shape, dtype=cupy.uint8) for _ in range(cfg.layers)]
        elif self.backend == "torch":
            import torch

            self.layers = [
                torch.zeros(shape, dtype=torch.uint8, device="cuda") for _ in range(cfg.layers)
            ]
        else:
            self.layers = [np.zeros(shape, dtype=np.uint8) for _ in range(cfg.layers)]
        free = list(range(cfg.pool_pages))
        random.Random(seed).shuffle(free)
        self.free: deque[int] = deque(free)

    def alloc(self, n: int) -> np.ndarray | None:
        if n > len(self.free):
            return None
        return np.array([self.free.popleft() for _ in range(n)], dtype=np.int64)

    def release(self, pages: np.ndarray) -> None:
        self.free.extend(int(p) for p in pages)

    def fill(self, room: int, pages: np.ndarray) -> None:
        """Write the room's pattern into these pages (the prefill's 'forward pass')."""
        logical = np.arange(len(pages))
        for layer, arr in enumerate(self.layers):
            data = expected_pages(room, logical, layer, self.cfg.page_bytes)
            if self.backend == "numpy":
                arr[pages] = data
            elif self.backend == "cupy":
                import cupy

                arr[cupy.asarray(pages)] = cupy.asarray(data)
            else:
                import torch

                arr[torch.as_tensor(pages, device="cuda")] = torch.from_numpy(data).cuda()
        self._sync()  # UCX does not order itself after pending CUDA work

    def verify(self, room: int, pages: np.ndarray) -> int:
        """Number of pages (over all layers) whose bytes differ from the room's pattern."""
        bad = 0
        logical = np.arange(len(pages))
        for layer, arr in enumerate(self.layers):
            want = expected_pages(room, logical, layer, self.cfg.page_bytes)
            if self.backend == "numpy":
                got = arr[pages]
            elif self.backend == "cupy":
                import cupy

                got = cupy.asnumpy(arr[cupy.asarray(pages)])
            else:
                import torch

                got = arr[torch.as_tensor(pages, device="cuda")].cpu().numpy()
            diff = got.view(np.uint64) != want.view(np.uint64)  # 8 bytes per compare
            bad += int(np.count_nonzero(diff.any(axis=1)))
        return bad

    def _sync(self) -> None:
        if self.backend == "cupy":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        elif self.backend == "torch":
            import torch

            torch.cuda.synchronize()


def cuda_backend() -> str:
    """'cupy' or 'torch' if one of them sees a CUDA device; a clear error otherwise."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:  # not installed, or no driver/device
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except Exception:
        pass
    raise KVStateError(
        "--device cuda needs a CUDA device and cupy or torch built with CUDA; none was "
        "found here (use --device cpu)"
    )
