"""A transfer info as operators read it (``kvstate show``): its pages as runs, what the
sender moves for it, as JSON and as text. numpy loads only with decoded pages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the codec (msgpack, numpy) loads when a transfer info is decoded
    from kvstate.codec import TransferInfo


RANGES_SHOWN = 100  # page runs of one transfer info in `show --json` (a scattered one: 16M)


def info_json(info: TransferInfo) -> dict[str, Any]:
    kv = info.kv_indices
    runs = run_count(kv)
    return {
        "pages": int(kv.size),
        "first_page": int(kv[0]) if kv.size else None,
        "last_page": int(kv[-1]) if kv.size else None,
        "runs": runs,
        "ranges": page_ranges(kv, RANGES_SHOWN),
        "ranges_more": max(0, runs - RANGES_SHOWN),
        "aux_index": info.aux_index,
        "state_pages": None if info.state_indices is None else int(info.state_indices.size),
        "prefix_len": info.prefix_len,
        "dummy": info.dummy,
        "incarnation": info.incarnation,
        "moves": moves(info),
        "receivers_declared": info.want,
    }


def moves(info: TransferInfo) -> str:
    """What the sender writes for this receiver: whole pages, some heads (tensor
    parallelism of different sizes, kvstate.tp), or nothing (a dummy)."""
    if info.dummy:
        return "nothing (dummy)"
    if info.heads is None:
        return "whole pages"
    src, dst, n = info.heads
    return f"heads {src}-{src + n - 1} -> {dst}-{dst + n - 1}"


def run_count(kv: Any) -> int:
    """How many runs of consecutive pages the page indices make."""
    import numpy as np  # with the decoded pages it counts (`ls` loads no numpy)

    return 0 if not kv.size else int(np.count_nonzero(np.diff(kv) != 1)) + 1


def page_ranges(kv: Any, most: int | None = None) -> list[list[int]]:
    """The page indices as runs of consecutive pages, in order: [[first, last], ...];
    the first ``most`` of them (all when None)."""
    import numpy as np  # with the decoded pages it reads (`ls` loads no numpy)

    if not kv.size:
        return []
    breaks = np.flatnonzero(np.diff(kv) != 1)[: None if most is None else most] + 1
    starts, ends = [0, *breaks.tolist()], [*breaks.tolist(), int(kv.size)]
    pairs = list(zip(starts, ends, strict=True))[: None if most is None else most]
    return [[int(kv[a]), int(kv[b - 1])] for a, b in pairs]


def fmt_ranges(ranges: list[list[int]], shown: int = 3, total: int | None = None) -> str:
    """``128..4223``; scattered pages as their first runs: ``928..929, 12, 5 +1 run``
    (``total``: how many runs there are, when ``ranges`` holds only the first)."""
    text = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in ranges[:shown])
    more = (len(ranges) if total is None else total) - shown
    return (text or "-") + (f" +{more} run{'s' if more > 1 else ''}" if more > 0 else "")
