"""SGLang's buffers as kvstate transports: one per index space (KV pages, aux, state),
registered from SGLang's raw pointers, and the backend's settings."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvstate.defaults import LEASE
from kvstate.errors import KVStateError, UnsupportedLayoutError
from kvstate.integrations.sglang.shape import KVShape, buffer_names, state_heads
from kvstate.integrations.sglang.slots import COUNTED
from transports.base import (
    Geometry,
    Heads,
    Target,
    Transport,
    TransportError,
    TransportStats,
)

# -- settings and buffers ----------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    url: str | None = None
    namespace: str | None = None
    host: str | None = None
    max_rooms: int = 65536
    lease: float = LEASE
    memory: str | None = None
    step_cache_s: float = 0.5  # a cached poll older than this is asked again
    store_grace_s: float = 30.0  # Redis unreachable this long: rooms fail locally
    # s a prefill keeps a room's pages for a decode that never publishes them (nor holds
    # the request in its queue); NixlConnector's lease is 30 s too.
    # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, when set, wins
    bootstrap_timeout: float = 30.0
    hold_for_s: float = 8.0  # a decode holds its queued rooms this long, renewed each 1/4

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        return cls(
            url=env.get("KVSTATE_REDIS_URL") or None,
            namespace=env.get("KVSTATE_NAMESPACE") or None,
            host=env.get("KVSTATE_SGLANG_HOST") or None,
            max_rooms=int(env.get("KVSTATE_SGLANG_MAX_ROOMS", "65536")),
            lease=float(env.get("KVSTATE_SGLANG_LEASE", str(LEASE))),
            memory=env.get("KVSTATE_SGLANG_MEMORY") or None,
            bootstrap_timeout=float(
                env.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
                or env.get("KVSTATE_SGLANG_BOOTSTRAP_TIMEOUT")
                or "30"
            ),
            hold_for_s=float(env.get("KVSTATE_SGLANG_HOLD", "8")),
        )


class _DeviceBuffer:
    """A raw device pointer presented as a 1-D byte array (CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def raw_buffer(ptr: int, nbytes: int, memory: str) -> Any:
    """SGLang hands buffers over as (pointer, length): view them without copying."""
    if memory == "cuda":
        return _DeviceBuffer(ptr, nbytes)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def default_memory() -> str:
    """Where the KV pool lives when ``KVSTATE_SGLANG_MEMORY`` does not say: on the GPU
    when torch sees one."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "host"
    except ImportError:
        return "host"


class Spaces(Transport):
    """KV pages, aux (metadata) slots and each state type's slots are separate index
    spaces: one transport each, published as one layout so one registration carries
    them. ``write`` (what ``KVSender.send`` calls) moves KV pages; ``write_space``
    moves aux and state slots."""

    def __init__(
        self,
        kv_args: Any,
        memory: str,
        factory: Callable[[], Transport] | None = None,
        shape: KVShape | None = None,
        dp: int = 1,
    ) -> None:
        self.dp = dp  # the engine's DP ranks, published so a decode waits for all of them
        if factory is None:
            from transports.ucx import UCXTransport

            factory = UCXTransport
        ptrs = kv_args.kv_data_ptrs or []
        self.kv = self._space(
            factory,
            ptrs,
            kv_args.kv_data_lens,
            kv_args.kv_item_lens,
            memory,
            shape.geometry(buffer_names(kv_args, shape.mla), len(ptrs)) if shape else None,
        )
        if self.kv is None:
            raise UnsupportedLayoutError("SGLang registered no KV buffers (kv_data_ptrs empty)")
        # SGLang keeps the metadata buffers in host memory
        self.aux = self._space(
            factory,
            getattr(kv_args, "aux_data_ptrs", None) or [],
            getattr(kv_args, "aux_data_lens", None) or [],
            getattr(kv_args, "aux_item_lens", None) or [],
            "host",
        )
        ptrs = getattr(kv_args, "state_data_ptrs", None) or []
        lens = getattr(kv_args, "state_data_lens", None) or []
        items = getattr(kv_args, "state_item_lens", None) or []
        # SWA pages split by KV heads as the KV pages do (state_heads), so that a sender
        # of another TP size writes only a decode rank's heads; other slots move whole
        self.state_heads = [
            state_heads(kv_args, shape, k) if shape else 0 for k in range(len(ptrs))
        ]
        self.state = [
            self._space(
                factory,
                p,
                n,
                i,
                memory,
                [Geometry("", h, shape.page_size)] * len(p) if h and shape else None,
            )
            for p, n, i, h in zip(ptrs, lens, items, self.state_heads, strict=True)
        ]

    @staticmethod
    def _space(
        factory: Callable[[], Transport],
        ptrs: Sequence[int],
        lens: Sequence[int],
        items: Sequence[int],
        memory: str,
        geometry: Sequence[Geometry] | None = None,
    ) -> Transport | None:
        if not ptrs:
            return None
        t = factory()
        t.register_buffers(
            [raw_buffer(int(p), int(n), memory) for p, n in zip(ptrs, lens, strict=True)],
            [int(i) for i in items],
            geometry,
        )
        return t

    def register_buffers(
        self,
        buffers: Sequence[Any],
        page_bytes: Sequence[int],
        geometry: Sequence[Geometry] | None = None,
    ) -> None:
        raise KVStateError("Spaces registers SGLang's buffers itself")

    def endpoint(self) -> bytes:
        assert self.kv is not None
        return self.kv.endpoint()

    def layout(self) -> dict[str, Any]:
        assert self.kv is not None
        return {
            "transport": "kvstate-sglang",
            "dp": self.dp,
            COUNTED: True,  # its receivers publish each state type's count (slots.pack)
            "kv": self.kv.layout(),
            "aux": self.aux.layout() if self.aux else None,
            "state": [s.layout() if s else None for s in self.state],
        }

    def expect(self, room: int, dst_indices: np.ndarray) -> None:
        assert self.kv is not None
        self.kv.expect(room, dst_indices)

    def write(
        self, room: int, src_indices: np.ndarray, targets: Sequence[Target], timeout: float
    ) -> None:
        assert self.kv is not None
        self.kv.write(
            room,
            src_indices,
            [replace(t, layout=t.layout["kv"]) for t in targets],
            timeout,
        )

    def write_space(
        self,
        space: Transport | None,
        remote: dict[str, Any] | None,
        what: str,
        room: int,
        endpoint: bytes,
        src: np.ndarray,
        dst: np.ndarray,
        timeout: float,
        heads: Heads | None = None,
    ) -> None:
        """Aux or state slots ``src`` into ``dst`` of one receiver (``heads``: only those
        heads of each page)."""
        if space is None or remote is None:
            raise TransportError(f"room {room}: {what} is not registered on both sides")
        space.write(room, src, [Target(endpoint, remote, dst, heads)], timeout)

    def release(self, room: int) -> None:
        assert self.kv is not None
        self.kv.release(room)

    def close(self) -> None:
        for t in (self.kv, self.aux, *self.state):
            if t is not None:
                t.close()

    @property
    def stats(self) -> TransportStats:
        assert self.kv is not None
        return self.kv.stats
