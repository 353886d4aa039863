"""Durable mode's cost: plain and durable mode on the same primaries, one replica each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

from kvstate.testing import RedisCluster, RedisProcess, RoundTrips
from tools.bench.state.redis_cost import redis_us
from tools.bench.state.workload import apart_room, batch_lifecycles, connect, lifecycle, pair


@contextmanager
def primary_with_replica() -> Iterator[tuple[RedisProcess, RedisProcess]]:
    """A standalone primary (TCP) and its replica, in sync."""
    with (
        RedisProcess(port="auto", extra_args=["--repl-diskless-sync-delay", "0"]) as primary,
        RedisProcess(port="auto") as replica,
    ):
        with replica.client() as c:
            c.replicaof(primary.host, primary.port)
        with primary.client() as c:
            deadline = time.monotonic() + 60
            while c.info("replication").get("slave0", {}).get("state") != "online":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not come online within 60 s")
                time.sleep(0.05)
        yield primary, replica


def durable_cost(
    url: str, primaries: list[redis.Redis], replicas: list[redis.Redis], n: int, batch: int
) -> dict[str, Any]:
    """Plain and durable mode on the same deployment, in many short rounds that each run
    both (each mode first in half of them): per lifecycle, round trips, Redis command
    us (WAIT included), CPU us of the primaries and of the replicas, lifecycles/s; and
    durable / plain throughput as the median of the rounds' ratios (a load swing on a
    shared host moves a round, not the median)."""
    pages = np.arange(0, 4096, dtype=np.int32)
    modes = ("plain", "durable")
    stores = {m: connect(f"{url}?durable={m == 'durable'}", "bench") for m in modes}
    rounds = max(8, n // 50)
    single, batches = max(n // rounds, 1), max(n // rounds // batch, 1)
    took: dict[str, dict[str, list[float]]] = {m: {"single": [], "batched": []} for m in modes}
    spent = {
        m: dict.fromkeys(("redis_cmd_us", "redis_cpu_us", "replica_cpu_us"), 0.0) for m in modes
    }
    out: dict[str, Any] = {}
    with pair(stores["plain"], 0) as plain, pair(stores["durable"], 1) as durable:
        engines = {"plain": plain, "durable": durable}
        for mode, (p, d) in engines.items():
            lifecycle(p, d, 0, pages)  # warm
            room = apart_room(stores[mode], p.bootstrap_addr, 100)
            with RoundTrips.installed() as rt:
                before = rt.count
                lifecycle(p, d, room, pages)
                out[f"{mode}_round_trips_per_lifecycle"] = rt.count - before
        room = 1000
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                p, d = engines[mode]
                cmd0, cpu0 = redis_us(primaries)
                rcpu0 = redis_us(replicas)[1]
                t0 = time.perf_counter()
                for _ in range(single):
                    lifecycle(p, d, room, pages)
                    room += 1
                t1 = time.perf_counter()
                for _ in range(batches):
                    batch_lifecycles(p, d, range(room, room + batch), pages)
                    room += batch
                t2 = time.perf_counter()
                cmd1, cpu1 = redis_us(primaries)
                took[mode]["single"].append(t1 - t0)
                took[mode]["batched"].append(t2 - t1)
                spent[mode]["redis_cmd_us"] += cmd1 - cmd0
                spent[mode]["redis_cpu_us"] += cpu1 - cpu0
                spent[mode]["replica_cpu_us"] += redis_us(replicas)[1] - rcpu0
    for store in stores.values():
        store.close()
    lifecycles = rounds * (single + batches * batch)
    for mode in modes:
        out[f"{mode}_single_lifecycles_per_s"] = round(
            rounds * single / sum(took[mode]["single"]), 1
        )
        out[f"{mode}_batched_lifecycles_per_s"] = round(
            rounds * batches * batch / sum(took[mode]["batched"]), 1
        )
        for name, us in spent[mode].items():
            out[f"{mode}_{name}_per_lifecycle"] = round(us / lifecycles, 1)
    for kind in ("single", "batched"):
        ratios = [a / b for a, b in zip(took["plain"][kind], took["durable"][kind], strict=True)]
        out[f"{kind}_durable_vs_plain_median"] = round(float(np.median(ratios)), 3)
        out[f"{kind}_durable_vs_plain_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    out["lifecycles_per_mode"] = lifecycles
    out["rounds"] = rounds
    return out


def durable_runs(n: int, batch: int, cluster: bool) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with primary_with_replica() as (primary, replica):
        results["standalone"] = durable_cost(
            primary.tcp_url, [primary.client()], [replica.client()], n, batch
        )
    if cluster:
        with RedisCluster(3, 1) as c:
            primaries = [n.client() for n in c.primaries()]
            replicas = [n.client() for n in c.nodes if c.role(n) == "slave"]
            results["cluster3_with_replicas"] = durable_cost(
                c.url, primaries, replicas, max(n // 2, 2 * batch), batch
            )
    return results
