"""The scripts by FCALL (the Redis 7 function library) against the EVAL path forced."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstate.testing import RedisProcess
from tools.bench.state.redis_cost import RedisCost, primaries
from tools.bench.state.rounds import median_range
from tools.bench.state.workload import batch_lifecycles, connect, lifecycle, pair


def fcall_vs_eval(url: str, server: RedisProcess, n: int, batch: int) -> dict[str, Any]:
    """The scripts by FCALL (the library, Redis 7) and by EVALSHA (the EVAL path forced)
    on the same server, in short rounds that each run both (each first in half of
    them): Redis command and CPU us per lifecycle, single and batched, and FCALL / EVAL
    as the median of the rounds' ratios (a load swing moves a round, not the median)."""
    pages = np.arange(0, 4096, dtype=np.int32)
    nodes = primaries(server)
    modes = ("fcall", "eval")
    stores = {m: connect(url, f"bench-{m}", eval_only=m == "eval") for m in modes}
    rounds = max(10, min(20, n // 100))
    single, batches = max(n // rounds, 1), max(n // rounds // batch, 1)
    kinds = ("single", "batched")
    per: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {k: {"cmd": [], "cpu": []} for k in kinds} for m in modes
    }  # per round
    cost = RedisCost(nodes)
    with pair(stores["fcall"], 20) as fc, pair(stores["eval"], 21) as ev:
        engines = {"fcall": fc, "eval": ev}
        room = 0
        for p, d in engines.values():
            batch_lifecycles(p, d, range(room, room + batch), pages)  # warm
            room += batch
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                p, d = engines[mode]
                for kind, count in (("single", single), ("batched", batches * batch)):
                    with cost.measuring():
                        if kind == "single":
                            for _ in range(single):
                                lifecycle(p, d, room, pages)
                                room += 1
                        else:
                            for _ in range(batches):
                                batch_lifecycles(p, d, range(room, room + batch), pages)
                                room += batch
                    per[mode][kind]["cmd"].append(sum(cost.cmd_us) / count)
                    per[mode][kind]["cpu"].append(sum(cost.cpu_us) / count)
    for store in stores.values():
        store.close()
    for c in nodes:
        c.close()
    out: dict[str, Any] = {"rounds": rounds}
    for kind in kinds:
        for what in ("cmd", "cpu"):
            f, e = per["fcall"][kind][what], per["eval"][kind][what]
            for mode, values in (("fcall", f), ("eval", e)):
                out[f"{kind}_{mode}_redis_{what}_us_per_lifecycle"] = round(
                    float(np.mean(values)), 1
                )
            ratio = f"{kind}_redis_{what}_fcall_over_eval"
            out[ratio], out[f"{ratio}_range"] = median_range(
                [a / b for a, b in zip(f, e, strict=True) if b], 3
            )
    return out
