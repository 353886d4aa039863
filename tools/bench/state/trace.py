"""The room trace's cost: off, at the default rate and on every room, alternated."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import kvstate
from kvstate.defaults import TRACE_RATE
from kvstate.testing import RedisCluster, RedisProcess, RoundTrips
from tools.bench.state.redis_cost import RedisCost, primaries
from tools.bench.state.workload import apart_room, batch_lifecycles, connect, lifecycle, pair

TRACE_MODES = {"off": 0.0, "default": TRACE_RATE, "full": 1.0}


def trace_cost(url: str, server: RedisProcess | RedisCluster, n: int, batch: int) -> dict[str, Any]:
    """The trace off, at the default rate and on every room (100%), on one deployment
    in many short rounds that each run all three (the order rotated): per lifecycle,
    round trips, Redis command us (scripts + EXEC), Redis CPU us, commands run;
    lifecycles/s against off as the median of the rounds' ratios; the Redis memory of
    one room's trace once cleared (what a traced room leaves for its trace TTL)."""
    pages = np.arange(0, 4096, dtype=np.int32)
    nodes = primaries(server)
    stores = {
        m: connect(url, "bench", options=kvstate.Options(trace_rate=rate))
        for m, rate in TRACE_MODES.items()
    }
    modes = list(TRACE_MODES)
    rounds = max(9, n // 50)
    single, batches = max(n // rounds, 1), max(n // rounds // batch, 1)
    took: dict[str, dict[str, list[float]]] = {m: {"single": [], "batched": []} for m in modes}
    spent = {m: dict.fromkeys(("redis_cmd_us", "redis_cpu_us", "commands"), 0.0) for m in modes}
    out: dict[str, Any] = {}
    with (
        pair(stores["off"], 10) as off,
        pair(stores["default"], 11) as default,
        pair(stores["full"], 12) as full,
    ):
        engines = {"off": off, "default": default, "full": full}
        for mode, (p, d) in engines.items():
            lifecycle(p, d, 0, pages)  # warm
            room = apart_room(stores[mode], p.bootstrap_addr, 100)
            with RoundTrips.installed() as rt:
                before = rt.count
                lifecycle(p, d, room, pages)
                out[f"{mode}_round_trips_per_lifecycle"] = rt.count - before
        p, d = engines["full"]
        lifecycle(p, d, 2, pages)
        key = stores["full"].keys.trace(2)
        node: Any = stores["full"].client
        if stores["full"].cluster:
            node = node.get_node_from_key(key).redis_connection
        out["trace_bytes_per_room"] = int(node.memory_usage(key, samples=0) or 0)
        out["trace_entries_per_room"] = int(node.llen(key))
        room = 1000
        cost = RedisCost(nodes)
        for r in range(rounds):
            for mode in modes[r % 3 :] + modes[: r % 3]:
                p, d = engines[mode]
                with cost.measuring():
                    t0 = time.perf_counter()
                    for _ in range(single):
                        lifecycle(p, d, room, pages)
                        room += 1
                    t1 = time.perf_counter()
                    for _ in range(batches):
                        batch_lifecycles(p, d, range(room, room + batch), pages)
                        room += batch
                    t2 = time.perf_counter()
                took[mode]["single"].append(t1 - t0)
                took[mode]["batched"].append(t2 - t1)
                spent[mode]["redis_cmd_us"] += sum(cost.cmd_us)
                spent[mode]["redis_cpu_us"] += sum(cost.cpu_us)
                spent[mode]["commands"] += sum(cost.calls)
    for store in stores.values():
        store.close()
    for c in nodes:
        c.close()
    lifecycles = rounds * (single + batches * batch)
    for mode in modes:
        for name, total in spent[mode].items():
            out[f"{mode}_{name}_per_lifecycle"] = round(total / lifecycles, 1)
    for mode in ("default", "full"):
        for kind in ("single", "batched"):
            ratios = [a / b for a, b in zip(took["off"][kind], took[mode][kind], strict=True)]
            out[f"{kind}_{mode}_vs_off_median"] = round(float(np.median(ratios)), 3)
            out[f"{kind}_{mode}_vs_off_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    out["default_rate"] = TRACE_RATE
    out["lifecycles_per_mode"] = lifecycles
    out["rounds"] = rounds
    return out
