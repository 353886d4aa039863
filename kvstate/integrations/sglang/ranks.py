"""SGLang prefill ranks as kvstate engines: the name each registers under
(``<addr>/dp<d>/tp<t>``, ``/pp<p>`` added on a pipeline-parallel prefill), and what a
decode reads back from the registry in place of SGLang's bootstrap server: the
prefill's DP, TP and PP sizes and the KV heads per page its ranks registered."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstate.registry import EngineInfo

_ENGINE = re.compile(r"^(?P<addr>.+)/dp(?P<dp>\d+)/tp(?P<tp>\d+)(?:/pp(?P<pp>\d+))?$")


@dataclass
class PrefillInfo:
    """What decode's scheduler reads from ``prefill_info_table`` (found in the registry)."""

    dp_size: int
    tp_size: int
    follow_bootstrap_room: bool = True
    page_heads: int | None = None  # KV heads per page its ranks registered (kvstate's)
    pp_size: int = 1


def prefill_engine(addr: str, dp_rank: int, tp_rank: int, pp_rank: int = 0, pp: int = 1) -> str:
    """The engine name of one prefill rank (a PP stage's when ``pp`` > 1)."""
    name = f"{addr}/dp{dp_rank}/tp{tp_rank}"
    return f"{name}/pp{pp_rank}" if pp > 1 else name


def prefill_info(peers: Sequence[EngineInfo]) -> PrefillInfo | None:
    """The prefill's parallel layout from its registered ranks; None until every rank of
    it registered (SGLang asks again)."""
    ranks = set()
    for p in peers:
        m = _ENGINE.match(p.engine)
        if m:
            ranks.add((int(m["dp"]), int(m["tp"]), int(m["pp"] or 0)))
    if not ranks:
        return None
    # each rank registers how many ranks one DP rank of it has (TP x PP): a partial
    # registry (a stage or rank not up yet) must not pass for a smaller prefill
    per_dp = max(p.ranks for p in peers)
    tp = max(t for _, t, _ in ranks) + 1
    dp = max(d for d, _, _ in ranks) + 1
    pp = max(s for _, _, s in ranks) + 1
    # and how many DP ranks it has (its layout, kvstate's SGLang spaces): DP rank 0 alone
    # must not pass for a prefill of one DP rank (the decode keeps the table it read)
    dp_size = max(int(p.layout.get("dp", 0) or 0) for p in peers)
    if tp * pp != per_dp or len(ranks) < dp * per_dp or dp < dp_size:
        return None
    return PrefillInfo(dp_size=dp, tp_size=tp, page_heads=page_heads(peers[0].layout), pp_size=pp)


def page_heads(layout: dict[str, Any]) -> int | None:
    """KV heads per page a registered Spaces layout declares (0: whole pages; None: not
    a kvstate SGLang layout)."""
    kv = layout.get("kv") if layout.get("transport") == "kvstate-sglang" else None
    buffers = kv.get("buffers") if isinstance(kv, dict) else None
    if not buffers or not isinstance(buffers[0], dict):
        return None
    return int(buffers[0].get("heads", 0) or 0)


__all__ = ["PrefillInfo", "page_heads", "prefill_engine", "prefill_info"]
