"""A decode's state indices as it publishes them: how many state types, each type's
count, then each type's indices in order. A flat list of every type's indices (what
this backend published before) lets a sender pair one type's pages with another's when
two types' counts differ the opposite ways; with the counts a sender checks each type
against its own and refuses, with the reason, what it cannot pair exactly.

A decode's layout says it publishes counts (``COUNTED``), so a sender still reads a
decode of an earlier kvstate (a flat list, checked by its total only), and an earlier
sender reading counts sees more slots than it has and refuses the room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transports.base import TransportError

COUNTED = "state_counts"  # the layout key of a decode that publishes counts


def pack(state_indices: Sequence[Any] | None) -> np.ndarray | None:
    """SGLang's per-type state indices (None: a type this room has none of) as one
    array: ``[types, count_0, ..., count_n-1, indices of type 0, ...]``."""
    if not state_indices:
        return None
    parts = [
        np.empty(0, np.int64) if s is None else np.asarray(s, dtype=np.int64).reshape(-1)
        for s in state_indices
    ]
    head = np.array([len(parts), *(p.size for p in parts)], np.int64)
    return np.concatenate([head, *parts])


def unpack(
    published: np.ndarray | None,
    counted: bool,
    mine: Sequence[tuple[int, np.ndarray]],
    room: int,
    receiver: str,
) -> list[np.ndarray]:
    """The decode's indices for each of this sender's ``(type, indices)`` in ``mine``;
    TransportError when a type's count differs (a window a page shorter, say) or the
    decode published slots of a type this sender has none of."""
    dst = np.empty(0, np.int64) if published is None else published.astype(np.int64)
    if not counted:  # a decode of an earlier kvstate: one flat list of every type
        total = sum(s.size for _, s in mine)
        if total != dst.size:
            raise TransportError(
                f"room {room}: {total} state slots here, {dst.size} published by {receiver}"
            )
        ends = np.cumsum([s.size for _, s in mine], dtype=np.int64)
        return [dst[end - s.size : end] for (_, s), end in zip(mine, ends, strict=True)]
    types = int(dst[0]) if dst.size else 0
    counts = dst[1 : 1 + types]
    body = dst[1 + types :]
    if counts.size != types or int(counts.sum()) != body.size:
        raise TransportError(f"room {room}: {receiver} published malformed state indices")
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    out = []
    for i, src in mine:
        want = int(counts[i]) if i < types else 0
        if want != src.size:
            raise TransportError(
                f"room {room}: state type {i}: {src.size} slots here, {want} published by "
                f"{receiver}"
            )
        out.append(body[starts[i] : starts[i] + want])
    extra = sorted(set(np.flatnonzero(counts).tolist()) - {i for i, _ in mine})
    if extra:
        raise TransportError(
            f"room {room}: {receiver} published slots of state type(s) {extra}, none here"
        )
    return out


__all__ = ["COUNTED", "pack", "unpack"]
