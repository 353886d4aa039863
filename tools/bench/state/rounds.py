"""The workload in short rounds, each against its own sample of the PING bound.

The bound: redis-py ``ping()`` over a unix socket and a raw ``PING`` over TCP, in round
trips per second; a lifecycle's bound is that rate over its round trips.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np
import redis

import kvstate
from kvstate.testing import RedisCluster, RedisProcess
from tools.bench.state.redis_cost import RedisCost
from tools.bench.state.workload import batch_lifecycles, lifecycle


def ping_unix(server: RedisProcess, n: int) -> float:
    c = redis.Redis(unix_socket_path=server.unix_socket)
    c.ping()
    t0 = time.perf_counter()
    for _ in range(n):
        c.ping()
    rate = n / (time.perf_counter() - t0)
    c.close()
    return rate


def ping_raw_tcp(host: str, port: int, n: int) -> float:
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        for _ in range(n):
            s.sendall(b"PING\r\n")
            got = b""
            while not got.endswith(b"\r\n"):
                got += s.recv(64)
        return n / (time.perf_counter() - t0)


def median_range(values: list[float], digits: int) -> tuple[float, list[float]]:
    """The median of ``values`` and their [min, max], rounded."""
    return round(float(np.median(values)), digits), [
        round(min(values), digits),
        round(max(values), digits),
    ]


def workload_rounds(
    server: RedisProcess | RedisCluster,
    nodes: list[redis.Redis],
    p: kvstate.KVManager,
    d: kvstate.KVManager,
    pages: np.ndarray,
    n: int,
    batch: int,
    trips: int,
) -> dict[str, Any]:
    """``n`` single and ~``n`` batched lifecycles in short rounds; on a standalone server
    each round also samples both PING bounds (as many PINGs as the round's single
    lifecycles make round trips; PING first in every other round). Each round's
    lifecycles/s is divided by its own bound and the median of those ratios is reported
    with their range: a load swing on a shared host moves a round and its bound
    together, where one PING sample after the workload moved the ratio with it.
    Returns the Redis cost of each kind (RedisCost sums, PINGs left out) and the rates."""
    rounds = max(8, min(20, n // 50))
    per_round = [n // rounds + (r < n % rounds) for r in range(rounds)]
    nb = max(n // batch, 1)
    batches = [nb // rounds + (r < nb % rounds) for r in range(rounds)]
    totals = {kind: RedisCost(nodes) for kind in ("single", "batched")}
    block = RedisCost(nodes)
    took: dict[str, list[float]] = {"single": [], "batched": []}
    done: dict[str, list[int]] = {"single": [], "batched": []}
    bounds: dict[str, list[float]] = {"unix": [], "raw_tcp": []}
    room, broom = 100_000, 300_000

    def sample_bounds(pings: int) -> None:
        if isinstance(server, RedisProcess):
            bounds["unix"].append(ping_unix(server, pings))
            bounds["raw_tcp"].append(ping_raw_tcp(server.host, server.port, pings))

    for r in range(rounds):
        if r % 2 == 0:
            sample_bounds(max(per_round[r] * trips, 300))
        with block.measuring():
            t0 = time.perf_counter()
            for _ in range(per_round[r]):
                lifecycle(p, d, room, pages)
                room += 1
            took["single"].append(time.perf_counter() - t0)
        totals["single"].add(block)
        with block.measuring():
            t0 = time.perf_counter()
            for _ in range(batches[r]):
                batch_lifecycles(p, d, range(broom, broom + batch), pages)
                broom += batch
            took["batched"].append(time.perf_counter() - t0)
        totals["batched"].add(block)
        done["single"].append(per_round[r])
        done["batched"].append(batches[r] * batch)
        if r % 2 == 1:
            sample_bounds(max(per_round[r] * trips, 300))
    out: dict[str, Any] = dict(totals)
    for kind in ("single", "batched"):
        out[f"{kind}_lifecycles_per_s"] = round(sum(done[kind]) / sum(took[kind]), 1)
    if not bounds["unix"]:
        return out
    out["ping_rounds"] = rounds
    for name, key in (("unix", "ping_redis_py_unix_per_s"), ("raw_tcp", "ping_raw_tcp_per_s")):
        out[key], out[f"{key}_range"] = median_range(bounds[name], 1)
        for kind in ("single", "batched"):
            ratios = [
                (k / t) / (bound / trips)
                for k, t, bound in zip(done[kind], took[kind], bounds[name], strict=True)
                if k
            ]
            stem = f"{kind}_ratio_to_ping_bound_{name}"
            out[stem], out[f"{stem}_range"] = median_range(ratios, 3)
    return out
