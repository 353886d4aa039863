"""Client processes: lifecycles/s that one deployment sustains with k batched clients."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstate.testing import RedisCluster, RedisProcess
from tools.bench.state.redis_cost import RedisCost, primaries
from tools.bench.state.workload import batch_lifecycles, connect, pair


def client(url: str, worker: int, rooms: int, batch: int, start: Any, done: Any) -> None:
    """One client process (spawned): warm, ready, then its batched lifecycles timed."""
    store = connect(url, "bench")
    pages = np.arange(0, 4096, dtype=np.int32)
    with pair(store, worker) as (p, d):
        batch_lifecycles(p, d, range(batch), pages)  # warm
        done.put(None)  # ready
        start.wait()
        t0 = time.perf_counter()
        for b in range(rooms // batch):
            batch_lifecycles(p, d, range(1000 + b * batch, 1000 + (b + 1) * batch), pages)
        done.put((rooms // batch * batch, time.perf_counter() - t0))
    store.close()


def processes(
    url: str, server: RedisProcess | RedisCluster, counts: Sequence[int], rooms: int, batch: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    nodes = primaries(server)
    out: dict[str, Any] = {}
    for k in counts:
        start, done = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=client, args=(url, i + 1, rooms, batch, start, done))
            for i in range(k)
        ]
        for pr in procs:
            pr.start()
        for _ in procs:  # each connected and warm
            done.get(timeout=300)
        cost = RedisCost(nodes)
        with cost.measuring():
            t0 = time.perf_counter()
            start.set()
            results = [done.get(timeout=600) for _ in procs]
            wall = time.perf_counter() - t0
        for pr in procs:
            pr.join(30)
        total = sum(r[0] for r in results)
        out[f"{k}_procs"] = {
            "lifecycles_per_s": round(total / wall, 1),
            "redis_cpu_us_per_lifecycle": round(sum(cost.cpu_us) / total, 1),
            "busiest_primary_cpu_us_per_lifecycle": round(max(cost.cpu_us) / total, 1),
        }
    for c in nodes:
        c.close()
    return out
