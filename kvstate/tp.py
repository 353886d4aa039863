"""Which prefill rank writes which KV heads to which decode rank, when the two sides run
tensor parallelism of different sizes (docs/design.md, "Heterogeneous TP").

A model has ``kv_heads`` KV heads. A rank of a TP group of size ``tp`` holds
``max(1, kv_heads // tp)`` of them: ``[r * kv_heads / tp, ...)`` when there are at
least as many heads as ranks, else the one head ``r * kv_heads // tp`` (GQA with fewer
KV heads than ranks: each head replicated on ``tp / kv_heads`` ranks). With MLA every
rank holds the same latent (``kv_heads`` 1, whole pages). One size must divide the other.

Each decode rank reads every head it holds from exactly one prefill rank (replicas are
spread over the decode ranks); a prefill rank that no decode rank reads from gets a
*dummy* route from one decode rank (round robin), so every prefill rank's sender has a
receiver to wait for and concludes with the room. Every prefill rank then serves the
same number of decode ranks (``receivers_per_sender``): what its sender waits for.
Both sides compute the same table from the same four numbers; nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.errors import InvalidValueError
from transports.base import Heads


@dataclass(frozen=True)
class Route:
    """What one prefill rank writes for one decode rank: those ``heads`` of each page
    (None: whole pages), or, ``dummy``, nothing (it only waits for the room)."""

    heads: Heads | None = None
    dummy: bool = False


def local_heads(tp: int, kv_heads: int) -> int:
    """KV heads one rank of a TP group of size ``tp`` holds."""
    return max(1, kv_heads // tp)


def _check(prefill_tp: int, decode_tp: int, kv_heads: int) -> None:
    for name, n in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp), ("kv_heads", kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidValueError(f"{name} must be an int >= 1, got {n!r}")
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if big % small:
        raise InvalidValueError(
            f"prefill TP {prefill_tp} and decode TP {decode_tp}: one must divide the other"
        )
    for tp in (prefill_tp, decode_tp):
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise InvalidValueError(f"{kv_heads} KV heads over TP {tp}: one must divide the other")


def _first_head(rank: int, tp: int, kv_heads: int) -> int:
    """The first (global) head rank ``rank`` of a TP group holds."""
    return rank * kv_heads // tp


def routes(
    prefill_tp: int, decode_tp: int, kv_heads: int, decode_rank: int, *, mla: bool = False
) -> dict[int, Route]:
    """Prefill rank -> what it writes for ``decode_rank``: the ranks holding its heads
    (each head read once), plus the prefill ranks no decode rank reads from that fall to
    this one as dummies. ``mla``: one latent on every rank, whole pages."""
    heads = 1 if mla else kv_heads
    _check(prefill_tp, decode_tp, heads)
    if not 0 <= decode_rank < decode_tp:
        raise InvalidValueError(f"decode rank {decode_rank} outside TP {decode_tp}")
    out = {p: r for p, r in _reads(prefill_tp, decode_tp, heads, decode_rank, mla).items()}
    read = {p for d in range(decode_tp) for p in _reads(prefill_tp, decode_tp, heads, d, mla)}
    idle = [p for p in range(prefill_tp) if p not in read]
    for i, p in enumerate(idle):
        if i % decode_tp == decode_rank:
            out[p] = Route(dummy=True)
    return dict(sorted(out.items()))


def _reads(prefill_tp: int, decode_tp: int, heads: int, d: int, mla: bool) -> dict[int, Route]:
    """The prefill ranks decode rank ``d`` reads from, with the heads of each."""
    mine = local_heads(decode_tp, heads)
    first = _first_head(d, decode_tp, heads)
    out: dict[int, Route] = {}
    for g in range(first, first + mine):
        # the prefill ranks holding global head g; replicas spread over decode ranks
        lo = g * prefill_tp // heads if heads >= prefill_tp else g * (prefill_tp // heads)
        copies = 1 if heads >= prefill_tp else prefill_tp // heads
        p = lo + d % copies
        src = g - _first_head(p, prefill_tp, heads) if heads >= prefill_tp else 0
        r = out.get(p)
        if r is None:
            out[p] = Route(Heads(src, g - first, 1))
        else:
            assert r.heads is not None
            out[p] = Route(Heads(r.heads.src, r.heads.dst, r.heads.count + 1))
    if mla:  # whole pages: the latent is not split by heads
        return {p: Route() for p in out}
    return out


def receivers_per_sender(
    prefill_tp: int, decode_tp: int, kv_heads: int, *, mla: bool = False
) -> int:
    """How many decode ranks each prefill rank's sender waits for (reads and dummies):
    the same for every prefill rank."""
    counts = [0] * prefill_tp
    for d in range(decode_tp):
        for p in routes(prefill_tp, decode_tp, kv_heads, d, mla=mla):
            counts[p] += 1
    if len(set(counts)) != 1:  # the routes above always balance; a guard for changes
        raise InvalidValueError(f"prefill ranks serve unequal counts {counts}")
    return counts[0]


__all__ = ["Route", "local_heads", "receivers_per_sender", "routes"]
