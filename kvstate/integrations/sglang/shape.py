"""Which prefill ranks one SGLang decode rank reads a room's KV from, when the two sides
run attention TP of different sizes (``kvstate.tp`` routes them), and why a pair that
cannot move KV between them is refused.

SGLang's MHA pools hold a page as ``[page_size tokens, heads, head_dim]`` (the layout
Mooncake slices by heads too): each KV buffer is registered with ``Geometry(heads=
kv_head_num, outer=page_size)``, so a sender writes only the heads a decode rank holds.
MLA pools hold one latent per token on every rank: whole pages, one prefill rank per
decode rank, the others dummies (they move nothing and conclude with the room). Both
sides compute the table from the same numbers: the prefill's TP size (its ranks in the
registry), the decode's TP size, the model's KV heads, MLA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstate.errors import InvalidValueError
from kvstate.tp import Route, local_heads, receivers_per_sender, routes
from transports.base import Geometry


@dataclass(frozen=True)
class KVShape:
    """One rank's KV facts: attention TP size, the model's KV heads (1 for MLA), MLA,
    the heads one page holds here (0: not known, or MLA), tokens per page."""

    tp: int
    kv_heads: int
    mla: bool
    page_heads: int
    page_size: int

    @classmethod
    def of(cls, kv_args: Any, tp: int, mla: bool) -> KVShape:
        page_size = int(getattr(kv_args, "page_size", 1) or 1)
        if mla:
            return cls(tp, 1, True, 0, page_size)
        local = int(getattr(kv_args, "kv_head_num", 0) or 0)
        # not known (a pool SGLang sets no heads for): one per rank, routes rank i to
        # rank i, and refusal() refuses TP sizes that differ
        total = int(getattr(kv_args, "total_kv_head_num", 0) or 0) or local * tp or tp
        return cls(tp, total, False, local, page_size)

    def geometry(self, names: list[str] | None, count: int) -> list[Geometry] | None:
        """The KV buffers' geometry: their names (the layers they hold, so that a
        pipeline stage's buffers meet a decode's by name) and heads per page when known
        (None: unnamed whole pages)."""
        heads = 0 if self.mla else self.page_heads
        if names is None and not heads:
            return None
        return [
            Geometry(names[i] if names else "", heads, self.page_size if heads else 1)
            for i in range(count)
        ]


def buffer_names(kv_args: Any, mla: bool) -> list[str] | None:
    """The layer each KV buffer of SGLang's ``kv_data_ptrs`` holds, as ``k.<layer>`` /
    ``v.<layer>`` (MHA: every K buffer, then every V buffer) or ``kv.<layer>`` (MLA),
    from the stage's first layer (``prefill_start_layer``) on; None where SGLang lays
    them out otherwise (draft buffers appended, pools that report their layer ids)."""
    count = len(getattr(kv_args, "kv_data_ptrs", None) or [])
    if int(getattr(kv_args, "num_draft_entries", 0) or 0) or getattr(kv_args, "kv_layer_ids", []):
        return None
    start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    if mla:
        return [f"kv.{start + i}" for i in range(count)]
    if count % 2:
        return None
    half = count // 2
    return [f"k.{start + i}" for i in range(half)] + [f"v.{start + i}" for i in range(half)]


@dataclass(frozen=True)
class Plan:
    """A decode rank's receiver of one room: each prefill rank it waits for with its
    route, and how many decode ranks each prefill rank serves."""

    senders: dict[str, Route]
    per_sender: int


def refusal(addr: str, prefill_tp: int, prefill_heads: int | None, mine: KVShape) -> str:
    """Why this decode rank cannot read KV from the prefill at ``addr`` ('' if it can).
    ``prefill_heads``: the heads per page the prefill registered (None: unknown)."""
    try:
        receivers_per_sender(prefill_tp, mine.tp, mine.kv_heads, mla=mine.mla)
    except InvalidValueError as exc:
        return f"prefill {addr} (attention TP {prefill_tp}) to this decode (TP {mine.tp}): {exc}"
    if mine.mla:
        if prefill_heads:
            return (
                f"prefill {addr} registered KV pages split into {prefill_heads} heads, this "
                "decode holds an MLA latent: run both with the same model"
            )
        return ""
    want = local_heads(prefill_tp, mine.kv_heads)
    if prefill_tp != mine.tp and not mine.page_heads:
        return (
            f"prefill {addr} runs attention TP {prefill_tp}, this decode {mine.tp}, and "
            "SGLang gave no KV heads per rank (KVArgs.kv_head_num): run equal TP sizes"
        )
    if prefill_heads is not None and mine.page_heads and prefill_heads != want:
        return (
            f"prefill {addr} (attention TP {prefill_tp}) holds {prefill_heads} KV head(s) "
            f"per page, {want} expected for the {mine.kv_heads} KV heads this decode "
            "serves: run both with the same model"
        )
    return ""


def plan(engine_of: Any, prefill_tp: int, pp: int, mine: KVShape, rank: int) -> Plan:
    """Decode rank ``rank``'s senders for a prefill ``refusal`` accepted: each prefill
    rank its routes name, on every one of its ``pp`` pipeline stages
    (``engine_of(tp_rank, pp_rank)`` names them)."""
    table = routes(prefill_tp, mine.tp, mine.kv_heads, rank, mla=mine.mla)
    if prefill_tp == mine.tp and not mine.mla:  # rank i reads whole pages from rank i
        table = {p: Route() for p in table}
    return Plan(
        {engine_of(p, stage): r for p, r in table.items() for stage in range(pp)},
        receivers_per_sender(prefill_tp, mine.tp, mine.kv_heads, mla=mine.mla),
    )


def state_heads(kv_args: Any, mine: KVShape, index: int) -> int:
    """KV heads per page of state type ``index``'s buffers when its pages split by heads
    as the KV pages do, else 0 (slots move whole). Only SGLang's SWA pool does: the
    sliding-window layers' own MHA pool, pages ``[page_size, heads, head_dim]`` when
    ``swa_kv_cache_layout`` is "nhd", as many heads per rank as the full pool (what
    Mooncake's SWA head slicing assumes too)."""
    types = list(getattr(kv_args, "state_types", None) or [])
    if index >= len(types) or mine.mla or not mine.page_heads:
        return 0
    if getattr(types[index], "value", types[index]) != "swa":
        return 0
    if getattr(kv_args, "swa_kv_cache_layout", None) != "nhd":
        return 0
    lens = list(getattr(kv_args, "state_item_lens", None) or [])
    items = [int(i) for i in (lens[index] if index < len(lens) else None) or []]
    per = mine.page_size * mine.page_heads
    return mine.page_heads if items and not any(i % per for i in items) else 0


def state_refusal(
    kv_args: Any, mine: KVShape, prefill: str, prefill_tp: int, kinds: list[int]
) -> str:
    """Why this decode rank cannot load the state slots of types ``kinds`` (indices
    into ``kv_args.state_types``) from a prefill of attention TP ``prefill_tp`` ('' if
    it can): across TP sizes only SWA pages move, their heads sliced as the KV pages'."""
    if prefill_tp == mine.tp:
        return ""
    types = list(getattr(kv_args, "state_types", None) or [])
    pair = f"between attention TP {prefill_tp} (prefill {prefill}) and {mine.tp} (this decode)"
    for i in kinds:
        kind = str(getattr(types[i], "value", types[i])) if i < len(types) else f"#{i}"
        if state_heads(kv_args, mine, i):
            continue
        if kind == "mamba":
            return (
                f"Mamba state slots {pair}: SGLang shards each Mamba tensor per TP rank "
                "(conv and temporal state, GDN's q|k|v groups apart) and kvstate does not "
                "reslice them; run equal TP sizes"
            )
        if kind == "swa":
            return (
                f"SWA pages {pair}: kvstate slices them by KV heads only for an MHA pool "
                "in the NHD layout (swa_kv_cache_layout 'nhd') whose pages hold "
                f"{mine.page_heads or '?'} whole head(s) of {mine.page_size} tokens here; "
                "run equal TP sizes"
            )
        return (
            f"{kind} state slots {pair}: kvstate moves them between equal TP sizes only; "
            "run equal TP sizes"
        )
    return ""


def writes_slots(route_heads: tuple[int, int, int] | None, dummy: bool) -> bool:
    """Whether a sender writes a receiver's aux slot and its whole state slots: one
    sender per decode rank, the one that writes whole pages or its first heads (the
    others write heads only: of KV pages, and of SWA pages, ``state_heads``)."""
    return not dummy and (route_heads is None or route_heads[1] == 0)


__all__ = [
    "KVShape",
    "Plan",
    "buffer_names",
    "plan",
    "refusal",
    "state_heads",
    "state_refusal",
    "writes_slots",
]
