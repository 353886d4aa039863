"""One deployment's figures: round trips, rates against the PING bound, Redis cost per
lifecycle and per script, memory per room; and steps of many rooms (``--rooms-per-step``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import kvstate
from kvstate.defaults import LEASE
from kvstate.testing import RedisCluster, RedisProcess, RoundTrips
from tools.bench.state.memory import HELD_ROOMS, held_room_memory
from tools.bench.state.redis_cost import RedisCost, primaries, script_costs
from tools.bench.state.rounds import workload_rounds
from tools.bench.state.workload import apart_room, batch_lifecycles, connect, lifecycle, pair


def measure(
    url: str,
    server: RedisProcess | RedisCluster,
    n: int,
    batch: int,
    held: tuple[int, int] = HELD_ROOMS,
) -> dict[str, Any]:
    store = connect(url, "bench")
    nodes = primaries(server)
    pages = np.arange(0, 4096, dtype=np.int32)
    out: dict[str, Any] = {}
    with pair(store) as (p, d):
        lifecycle(p, d, 0, pages)  # warm: scripts loaded, peers resolved
        batch_lifecycles(p, d, range(1, 1 + batch), pages)
        single_room = apart_room(store, p.bootstrap_addr, 100)  # a Cluster's most trips
        with RoundTrips.installed() as rt:
            before = rt.count
            lifecycle(p, d, single_room, pages)
            trips = rt.count - before
            before = rt.count
            batch_lifecycles(p, d, range(200, 200 + batch), pages)
            batch_trips = rt.count - before
            out["round_trips_per_lifecycle"] = trips
            out[f"round_trips_per_{batch}_batched_lifecycles"] = batch_trips
            out["round_trips_per_step"] = step_trips(p, d)

        rounds = workload_rounds(server, nodes, p, d, pages, n, batch, trips)
        single, batched = rounds.pop("single"), rounds.pop("batched")
        nb = max(n // batch, 1)
        for kind, cost, count in (("single", single, n), ("batched", batched, nb * batch)):
            out[f"{kind}_redis_cmd_us_per_lifecycle"] = round(sum(cost.cmd_us) / count, 1)
            out[f"{kind}_redis_cpu_us_per_lifecycle"] = round(sum(cost.cpu_us) / count, 1)
            out[f"{kind}_redis_commands_per_lifecycle"] = round(sum(cost.calls) / count, 1)
            out[f"{kind}_script_calls_per_lifecycle"] = round(sum(cost.scripts) / count, 2)
        out["batched_busiest_primary_cpu_us_per_lifecycle"] = round(
            max(batched.cpu_us) / (nb * batch), 1
        )
        out.update(rounds)

        def traced() -> None:
            for b in range(max(nb // 4, 2)):
                batch_lifecycles(p, d, range(400_000 + b * batch, 400_000 + (b + 1) * batch), pages)

        out["script_us_per_call"] = script_costs(nodes, traced)
        mem = out["room_memory"] = held_room_memory(store, nodes, p, d, pages, held)
        out["room_memory_bytes"] = mem["used_memory_bytes_per_room"]
        out["room_memory_usage_bytes"], out["room_keys"] = (
            mem["memory_usage_bytes_per_room"],
            len(mem["keys"]) - ("trace" in mem["keys"]),
        )
    store.close()
    for c in nodes:
        c.close()
    return out


def step_trips(p: kvstate.KVManager, d: kvstate.KVManager) -> dict[str, dict[str, int]]:
    """Round trips of one scheduler step's batched calls over every in-flight room. Its
    poll_many polls rooms that wait (polled once already, nobody changed them since):
    none with change notices (docs/design.md, "Change notices"), one per node without."""
    out: dict[str, dict[str, int]] = {}
    base = 50_000
    for n in (1, 64, 256):
        rooms = list(range(base, base + n))
        base += n
        for r in rooms:
            d.receiver(r, p.bootstrap_addr)
            p.sender(r)
        d.init_many(dict.fromkeys(rooms, np.arange(8)))
        p.poll_many(rooms)
        row: dict[str, int] = {}
        for name in ("poll_many", "begin_many", "finish_many", "clear_many"):
            before = RoundTrips.count
            getattr(p, name)(rooms)
            if name == "clear_many":
                d.clear_many(rooms)
            row[name] = RoundTrips.count - before
        out[f"{n}_rooms"] = row
    return out


def rooms_per_step(
    url: str, server: RedisProcess | RedisCluster, sizes: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Batched lifecycles of ``n`` rooms per step for each ``n`` in ``sizes`` (issue 22
    target 3: flat to 10,000): round trips per step (both sides, clears included),
    Redis command us, CPU us and commands per lifecycle; one step per size after a warm
    one, on a fresh manager pair so no earlier room is in flight. The managers keep the
    default lease (heartbeat every lease / 3): the trips their heartbeats make while a
    long step runs (2 per renewal, 1 more per peer check) are counted apart, by thread,
    and so is the Redis time they cost (a few commands each, left in the figures)."""
    store = connect(url, "bench-steps")
    nodes = primaries(server)
    pages = np.arange(0, 4096, dtype=np.int32)
    out: dict[str, dict[str, float]] = {}
    base = 1_000_000
    with pair(store, worker=9, lease=LEASE) as (p, d):
        beats = {f"kvstate-{p.engine}", f"kvstate-{d.engine}"}  # their heartbeat threads
        batch_lifecycles(p, d, range(base, base + 16), pages)  # warm
        base += 16
        for n in sizes:
            rooms = range(base, base + n)
            base += n
            cost = RedisCost(nodes)
            with RoundTrips.installed() as rt, cost.measuring():
                before, beat_before = rt.count, sum(rt.by_thread[t] for t in beats)
                t0 = time.perf_counter()
                batch_lifecycles(p, d, rooms, pages)
                took = time.perf_counter() - t0
                beat = sum(rt.by_thread[t] for t in beats) - beat_before
                trips = rt.count - before - beat
            out[f"{n}_rooms"] = {
                "round_trips_per_step": trips,
                "heartbeat_round_trips_meanwhile": beat,
                "step_s": round(took, 3),
                "redis_cmd_us_per_lifecycle": round(sum(cost.cmd_us) / n, 1),
                "redis_cpu_us_per_lifecycle": round(sum(cost.cpu_us) / n, 1),
                "redis_commands_per_lifecycle": round(sum(cost.calls) / n, 1),
                "lifecycles_per_s": round(n / took, 1),
            }
    store.close()
    for c in nodes:
        c.close()
    return out
