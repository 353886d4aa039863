"""The transport's registered buffers: what one is (``Region``: where it lies, its pages,
what they hold, as a sender's plan reads it) and how an array given to register is read
without a copy (``buffer_info``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import Geometry, LayoutError
from transports.ucx.abi import RequestParam


@dataclass
class Region:
    """One registered buffer (a layer or kind of KV cache)."""

    obj: Any  # keeps the caller's array alive while UCX has it mapped
    addr: int
    nbytes: int
    page_bytes: int
    num_pages: int
    memory: str  # "host" or "cuda"
    memh: int = 0
    rkey: bytes = b""
    param: RequestParam = field(default_factory=RequestParam)
    geometry: Geometry = field(default_factory=Geometry)

    def describe(self) -> dict[str, Any]:
        """This buffer in the transport's layout (what a sender plans its writes by)."""
        out: dict[str, Any] = {
            "addr": self.addr,
            "nbytes": self.nbytes,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "memory": self.memory,
            "rkey": self.rkey,
        }
        g = self.geometry
        if g.name:
            out["name"] = g.name
        if g.heads:
            out["heads"], out["outer"] = g.heads, g.outer
        return out


def buffer_info(obj: Any, what: str) -> tuple[int, int, str]:
    """(address, nbytes, memory kind) of a C-contiguous array, without copying it."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(s) for s in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
        if strides is not None:
            expected, step = [], itemsize
            for dim in reversed(shape):
                expected.append(step)
                step *= dim
            if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
                raise LayoutError(f"{what}: device array is not C-contiguous (strides {strides})")
        return int(cai["data"][0]), int(np.prod(shape)) * itemsize, "cuda"
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__array_interface__"):
            view = memoryview(np.asarray(obj))  # type: ignore[arg-type]
        elif callable(getattr(obj, "numpy", None)):  # a CPU torch tensor: a view, no copy
            view = memoryview(obj.numpy())
        else:
            raise LayoutError(
                f"{what}: {type(obj).__name__} is neither a buffer nor a CUDA array"
            ) from None
    if not view.c_contiguous:
        raise LayoutError(f"{what}: array is not C-contiguous (UCX would send its raw memory)")
    flat = np.frombuffer(
        view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8
    )
    return int(flat.__array_interface__["data"][0]), flat.nbytes, "host"
