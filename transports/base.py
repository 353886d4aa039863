"""What a transport is: the contract the KV manager codes against.

A transport moves KV pages between processes. It knows nothing about rooms'
state, Redis or requests: the caller publishes ``endpoint()`` and ``layout()``
wherever it likes (kvstate uses its engine registry) and hands them back to the
sender as :class:`Target` entries.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class TransportError(Exception):
    """A transfer failed; ``str()`` says why (peer gone, deadline, layout...)."""


class LayoutError(TransportError, ValueError):
    """Buffers or page indices do not fit; raised before any byte moves."""


@dataclass(frozen=True)
class Geometry:
    """What one registered buffer holds, beyond its page size: its ``name`` (the same KV
    layer or state on every engine, e.g. ``layer.12``: buffers are matched by name when
    both sides name theirs, so a pipeline stage writes its layers into a receiver that
    holds them all), and how a page splits into KV heads: ``outer`` blocks of ``heads``
    equal chunks, one per head (``[heads, tokens, dim]``: outer 1; ``[tokens, heads,
    dim]``: outer = tokens per page). ``heads`` 0: the page is not split by heads (an
    MLA latent, a state slot): it moves whole."""

    name: str = ""
    heads: int = 0
    outer: int = 1


@dataclass(frozen=True)
class Heads:
    """The part of each page a sender writes when the two sides hold different heads
    (tensor parallelism of another size): its heads ``[src, src + count)`` into the
    receiver's heads ``[dst, dst + count)``."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class Target:
    """One receiver of a room.

    ``endpoint`` and ``layout`` are what that receiver's transport returned from
    ``endpoint()`` and ``layout()``; ``dst_indices`` are its destination page
    indices in the same order as the sender's source indices. An empty
    ``dst_indices`` marks a dummy receiver: nothing is sent to it. ``heads``: write
    only those heads of each page (``Geometry``), None: whole pages. ``buffers``: write
    only the local buffers of these names, None: every buffer.
    """

    endpoint: bytes
    layout: dict[str, Any]
    dst_indices: np.ndarray
    heads: Heads | None = None
    buffers: tuple[str, ...] | None = None


#: one room's write: the room, its source page indices, its receivers
WriteJob = tuple[int, np.ndarray, Sequence[Target]]


@dataclass(frozen=True)
class TransportStats:
    """Counters for metrics: totals since the transport was created."""

    bytes_moved: int = 0
    transfers: int = 0
    failures: int = 0
    last_latency_s: float = 0.0
    last_bytes: int = 0


class Transport(ABC):
    """Registers local KV buffers and writes pages into remote ones.

    Callers stay synchronous; every blocking call has a deadline and reports
    failure as :class:`TransportError`, never by hanging.
    """

    @abstractmethod
    def register_buffers(
        self,
        buffers: Sequence[Any],
        page_bytes: Sequence[int],
        geometry: Sequence[Geometry] | None = None,
    ) -> None:
        """Register one array per layer/kind, its bytes per page and, optionally, what
        its pages hold (``Geometry``: names and heads, for partial and matched writes)."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """Opaque address other processes use to reach this transport."""

    @abstractmethod
    def layout(self) -> dict[str, Any]:
        """Description of the registered buffers (msgpack-able) for senders."""

    @abstractmethod
    def expect(self, room: int, dst_indices: np.ndarray) -> None:
        """Receiver side: check ``dst_indices`` fit and get pages ready for ``room``."""

    @abstractmethod
    def write(
        self,
        room: int,
        src_indices: np.ndarray,
        targets: Sequence[Target],
        timeout: float,
    ) -> None:
        """Sender side: put the source pages into every target's destination pages.

        Returns only once the bytes are in the receivers' memory; raises
        :class:`TransportError` otherwise, within ``timeout`` seconds.
        """

    def write_many(
        self, jobs: Sequence[WriteJob], timeout: float
    ) -> dict[int, int | TransportError]:
        """Sender side: ``write`` of several rooms (each once), all within ``timeout``
        seconds: each room answers its bytes moved, or the TransportError that failed it
        (the other rooms are still written). Here they are written in turn; a transport
        may write them together (UCXTransport: one pass per receiver)."""
        deadline = time.monotonic() + timeout
        out: dict[int, int | TransportError] = {}
        for room, src, targets in jobs:
            before = self.stats.bytes_moved
            try:
                self.write(room, src, targets, max(0.0, deadline - time.monotonic()))
            except TransportError as exc:
                out[room] = exc
            else:
                out[room] = self.stats.bytes_moved - before
        return out

    @abstractmethod
    def release(self, room: int) -> None:
        """Forget everything kept for ``room``; idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Release buffers and connections; idempotent."""

    @property
    @abstractmethod
    def stats(self) -> TransportStats:
        """A snapshot of the transfer counters."""
