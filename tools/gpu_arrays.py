"""Arrays for tools/gpu_check.py and tools/gpu_nixl.py: device arrays (cupy, else
torch), or numpy for a dry run on host memory, and the pages' contents and checks."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


class Device:
    """cupy or torch, whichever imports with CUDA: allocate, upload, download, copy."""

    def __init__(self, host: bool = False) -> None:
        self.kind = ""
        if host:  # --host-dry-run: numpy arrays, to check this script's plumbing anywhere
            self.kind = "numpy"
            return
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
            self.cp: Any = cupy
            self.kind = "cupy"
            return
        except Exception:
            pass
        try:
            import torch

            if torch.cuda.is_available():
                self.torch: Any = torch
                self.kind = "torch"
        except Exception:
            pass

    def upload(self, host: np.ndarray) -> Any:
        if self.kind == "numpy":
            return host.copy()
        if self.kind == "cupy":
            return self.cp.asarray(host)
        return self.torch.from_numpy(host).to("cuda")

    def zeros(self, nbytes: int) -> Any:
        if self.kind == "numpy":
            return np.zeros(nbytes, dtype=np.uint8)
        if self.kind == "cupy":
            return self.cp.zeros(nbytes, dtype=self.cp.uint8)
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")

    def download(self, arr: Any) -> np.ndarray:
        if self.kind == "numpy":
            return np.asarray(arr)
        if self.kind == "cupy":
            return self.cp.asnumpy(arr)
        return arr.cpu().numpy()

    def sync(self) -> None:
        if self.kind == "numpy":
            return
        if self.kind == "cupy":
            self.cp.cuda.runtime.deviceSynchronize()
        else:
            self.torch.cuda.synchronize()

    def copy(self, dst: Any, src: Any) -> None:
        if self.kind == "numpy":
            np.copyto(dst, src)
        elif self.kind == "cupy":
            dst[...] = src
        else:
            dst.copy_(src)

    def ptr(self, arr: Any) -> int:
        if self.kind == "numpy":
            return int(arr.ctypes.data)
        if self.kind == "cupy":
            return int(arr.data.ptr)
        return int(arr.data_ptr())

    def zero(self, bufs: list[Any]) -> None:
        for b in bufs:
            if self.kind in ("cupy", "numpy"):
                b.fill(0)
            else:
                b.zero_()
        self.sync()


def digests(dev: Device, bufs: list[Any]) -> list[str]:
    return [hashlib.sha256(dev.download(b).data).hexdigest() for b in bufs]


def expected(layers: int, nbytes: int, page_bytes: int, src: Any, dst: Any) -> list[str]:
    """The receiver's digests once the sender's pages ``src`` landed on ``dst``."""
    pages = nbytes // page_bytes
    want = []
    for layer in range(layers):
        s = host_layer(layer, nbytes).reshape(pages, page_bytes)
        d = np.zeros_like(s)
        d[dst] = s[src]
        want.append(hashlib.sha256(d.data).hexdigest())
    return want


def host_layer(layer: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(99 + layer).integers(0, 256, size=nbytes, dtype=np.uint8)


def fragmented(pages: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Runs of 1-8 pages in random places on each side (the transfer benchmark's)."""
    from tools.bench.transfer.workload import runs_layout

    return runs_layout(pages, 1, 8, seed)
