"""What a prefill engine hands the decode with each request (``kv_transfer_params``),
and whether and how the decode can take the request's KV from it.

The prefill's scheduler puts its ``KVFacts`` in ``kvstate_kv``: what must be equal on
both engines for a block there to mean a block here (layout, cache spec, layers, block
size, bytes per head, dtype, the model's KV heads, MLA) and what may differ (tensor and
pipeline parallel sizes). The decode's scheduler compares them with its own: a request
it cannot take is computed here instead (``refusal`` says why: logged once per pair of
engines, counted in ``vllm:kvstate_num_recompute_fallbacks``) and its room aborted so
the prefill frees its blocks. A request it can take is loaded by every decode rank from
the prefill ranks ``kvstate.tp`` routes it to (``senders``), on each pipeline stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from typing import Any

from kvstate.errors import InvalidValueError
from kvstate.integrations.vllm.groups import groups_of
from kvstate.integrations.vllm.layout import head_split, is_mla, layout_name, spec_of
from kvstate.integrations.vllm.settings import rank_name
from kvstate.tp import Route, local_heads, receivers_per_sender, routes

# facts that must be equal on both engines, and how a refusal names them
MUST_MATCH = {
    "layout": "KV cache layout",
    "spec": "KV cache spec",
    "layers": "layers",
    "block_size": "block size",
    "head_bytes": "bytes per head and block",
    "dtype": "dtype",
    "kv_heads": "KV heads",
    "mla": "MLA",
    "groups": "KV cache groups",
}


_KINDS = {"str": str, "int": int, "bool": bool}  # KVFacts' field types, by annotation


@dataclass(frozen=True)
class KVFacts:
    """One engine's KV cache as its peer must know it (JSON-safe: it travels through
    the router in ``kv_transfer_params['kvstate_kv']``). ``split`` is '' when pages
    split by KV heads, else why not."""

    layout: str
    spec: str
    layers: int
    block_size: int
    head_bytes: int
    dtype: str
    kv_heads: int  # the model's KV heads (1 for an MLA latent)
    mla: bool
    tp: int
    pp: int
    split: str = ""
    groups: str = ""  # the KV cache groups (groups.py), '; '-joined: one for most models

    @property
    def stateful(self) -> bool:
        """A Mamba / linear-attention state group: its pages are no KV heads."""
        return "MambaSpec" in self.groups

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_config: Any) -> KVFacts:
        """This engine's facts, from its config and the scheduler's KVCacheConfig."""
        spec = spec_of(kv_cache_config)
        mla = is_mla(spec)
        layout = layout_name(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        kv_heads = 1 if mla else int(vllm_config.model_config.get_total_num_kv_heads())
        tp = int(parallel.tensor_parallel_size)
        split = "" if mla else head_split(layout, spec)
        if not mla and spec.num_heads != local_heads(tp, kv_heads):
            split = split or (
                f"a rank holds {spec.num_heads} KV head(s) of the model's {kv_heads} at "
                f"TP {tp}, not {local_heads(tp, kv_heads)}"
            )
        return cls(
            layout=layout,
            spec=type(spec).__name__,
            # the model's, not this worker's: a pipeline stage holds some of them
            layers=int(vllm_config.model_config.get_total_num_hidden_layers()),
            block_size=int(spec.block_size),
            head_bytes=int(spec.num_states * spec.state_content_size_bytes),
            dtype=str(getattr(spec, "dtype", "?")).replace("torch.", ""),
            kv_heads=kv_heads,
            mla=mla,
            tp=tp,
            pp=int(parallel.pipeline_parallel_size),
            split=split,
            groups="; ".join(g.spec for g in groups_of(kv_cache_config)),
        )

    def params(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, value: object) -> KVFacts | None:
        """The facts a prefill sent (None if they are not a kvstate prefill's facts:
        each field of its type, as JSON carries it; ``plan`` keys its cache on them)."""
        if not isinstance(value, dict):
            return None
        kinds = {f.name: _KINDS[str(f.type)] for f in fields(cls)}
        got = {k: v for k, v in value.items() if k in kinds}
        if any(type(v) is not kinds[k] for k, v in got.items()):  # a bool is no int here
            return None
        try:
            return cls(**got)
        except TypeError:  # a field missing
            return None


def refusal(prefill: str, theirs: KVFacts | None, decode: str, mine: KVFacts) -> str:
    """Why ``decode`` cannot take KV from ``prefill`` ('' when it can)."""
    if theirs is None:
        return f"prefill {prefill} sent no KV cache facts kvstate can read"
    diff = [
        f"{what} {getattr(theirs, k)!r} there, {getattr(mine, k)!r} here"
        for k, what in MUST_MATCH.items()
        if getattr(theirs, k) != getattr(mine, k)
    ]
    if diff:
        return (
            f"prefill {prefill} and decode {decode} differ: {'; '.join(diff)}: run both "
            "with the same model, KV cache layout (VLLM_KV_CACHE_LAYOUT), block size and "
            "KV cache dtype"
        )
    try:
        receivers_per_sender(theirs.tp, mine.tp, mine.kv_heads, mla=mine.mla)
    except InvalidValueError as exc:
        return f"prefill {prefill} (TP {theirs.tp}) to decode {decode} (TP {mine.tp}): {exc}"
    if mine.stateful and theirs.tp != mine.tp:
        return (
            f"prefill {prefill} (TP {theirs.tp}) to decode {decode} (TP {mine.tp}): a "
            "Mamba / linear-attention state is not split by KV heads, so kvstate moves "
            "it between engines of the same tensor_parallel_size only"
        )
    heads = mine.kv_heads
    if not mine.mla and local_heads(theirs.tp, heads) != local_heads(mine.tp, heads):
        why = theirs.split or mine.split
        if why:
            return (
                f"prefill {prefill} (TP {theirs.tp}) to decode {decode} (TP {mine.tp}) needs "
                f"parts of pages, but {why}: use KV cache layout LBHNC on both (the one "
                "NixlConnector asks for) or the same tensor_parallel_size"
            )
    return ""


@dataclass(frozen=True)
class Plan:
    """What one decode rank's receiver of a request needs: each prefill worker it reads
    from (every pipeline stage of the prefill ranks its routes name) with its route,
    and how many decode ranks each prefill worker serves."""

    senders: dict[str, Route]
    per_sender: int


@lru_cache(maxsize=256)
def plan(prefill: str, theirs: KVFacts, mine: KVFacts, rank: int) -> Plan:
    """Decode rank ``rank``'s senders for a request whose facts ``refusal`` accepted.
    Made once per prefill engine and shape (~90 us): a step's requests share it (the
    receiver copies ``senders``)."""
    table = routes(theirs.tp, mine.tp, mine.kv_heads, rank, mla=mine.mla)
    senders = {
        rank_name(prefill, p, stage, theirs.pp): route
        for p, route in table.items()
        for stage in range(theirs.pp)
    }
    return Plan(senders, receivers_per_sender(theirs.tp, mine.tp, mine.kv_heads, mla=mine.mla))


__all__ = ["KVFacts", "Plan", "plan", "refusal"]
