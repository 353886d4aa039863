#!/usr/bin/env python3
"""Control-plane benchmark (docs/design.md, Targets): round trips and throughput of room lifecycles.

Prints, against baselines measured in the same run on private redis-servers:
- Redis round trips per full lifecycle (both sides, one poll each, both clears), counted
  at the socket (one write of a command or pipeline = one round trip); target <= 8;
- lifecycles/s against PING/s / round-trips (the bound a client doing nothing but
  waiting for Redis could reach); target >= 0.7;
- round trips for poll_many of 1000 rooms: target 1 per Redis node;
- Redis memory per in-flight room (MEMORY USAGE of its keys), 4096 contiguous pages;
  target <= 1 KiB.

    python tools/bench_state.py [--json] [--lifecycles 2000] [--no-cluster]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from redis.connection import AbstractConnection

import kvstate
from kvstate.testing import RedisCluster, RedisProcess

ADDR = "10.0.0.1:8998"


class RoundTrips:
    """Counts writes to Redis sockets in this process: each is one request/response trip."""

    count = 0

    @classmethod
    @contextmanager
    def installed(cls) -> Iterator[type[RoundTrips]]:
        original = AbstractConnection.send_packed_command

        def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
            cls.count += 1
            original(self, command, check_health)

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        try:
            yield cls
        finally:
            AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


def lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int, pages: np.ndarray) -> None:
    rcv = d.receiver(room, ADDR)
    rcv.init(pages)
    snd = p.sender(room)
    assert snd.poll() == kvstate.KVPoll.WaitingForInput
    snd.begin_transfer()
    snd.finish_transfer()
    assert rcv.poll() == kvstate.KVPoll.Success
    snd.clear()
    rcv.clear()


def measure(url: str, n: int) -> dict[str, Any]:
    store = kvstate.connect(url, namespace="bench")
    pages = np.arange(0, 4096, dtype=np.int32)
    hb = 3600.0  # keep heartbeats out of the counts
    with (
        kvstate.KVManager(store, "prefill", "prefill-a.tp0", ADDR, lease=hb) as p,
        kvstate.KVManager(store, "decode", "decode-b.tp0", lease=hb) as d,
    ):
        lifecycle(p, d, 0, pages)  # warm: scripts loaded, peers resolved
        with RoundTrips.installed() as rt:
            before = rt.count
            lifecycle(p, d, 1, pages)
            trips = rt.count - before

            rooms = list(range(10_000, 11_000))
            senders = [p.sender(r) for r in rooms]
            p.poll_many(rooms)  # creates them
            before = rt.count
            polled = p.poll_many(rooms)
            poll_many_trips = rt.count - before
            assert len(polled) == 1000
            for s in senders:
                s.clear()

        # memory of one in-flight room (both sides created, infos published)
        rcv = d.receiver(5, ADDR)
        rcv.init(pages)
        snd = p.sender(5)
        snd.poll()
        room_keys = list(store.scan(store.keys.room_prefix(5) + "*"))
        memory = 0
        for key in room_keys:
            node = store.client
            if store.cluster:
                node = store.client.get_node_from_key(key).redis_connection  # type: ignore[union-attr]
            memory += int(node.memory_usage(key, samples=0) or 0)
        snd.clear()
        rcv.clear()

        t0 = time.perf_counter()
        for i in range(n):
            lifecycle(p, d, 100_000 + i, pages)
        life_rate = n / (time.perf_counter() - t0)

    ping_client = store.client
    if store.cluster:
        ping_client = store.client.get_node_from_key(store.keys.room_prefix(1)).redis_connection  # type: ignore[union-attr]
    m = n * trips
    t0 = time.perf_counter()
    for _ in range(m):
        ping_client.ping()
    ping_rate = m / (time.perf_counter() - t0)
    store.close()
    bound = ping_rate / trips
    return {
        "round_trips_per_lifecycle": trips,
        "poll_many_1000_round_trips": poll_many_trips,
        "lifecycles_per_s": round(life_rate, 1),
        "ping_per_s": round(ping_rate, 1),
        "ping_bound_lifecycles_per_s": round(bound, 1),
        "ratio_to_ping_bound": round(life_rate / bound, 3),
        "room_memory_bytes": memory,
        "room_keys": len(room_keys),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--lifecycles", type=int, default=2000)
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-primary cluster run")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    with RedisProcess(port=0) as server:
        results["standalone"] = measure(server.url, args.lifecycles)
    if not args.no_cluster:
        with RedisCluster(3, 0) as cluster:
            results["cluster3"] = measure(cluster.url, max(args.lifecycles // 4, 100))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    targets = {
        "round_trips_per_lifecycle": "<= 8",
        "poll_many_1000_round_trips": "1 per node",
        "ratio_to_ping_bound": ">= 0.7",
        "room_memory_bytes": "<= 1024",
    }
    for name, res in results.items():
        print(f"[{name}]")
        for k, v in res.items():
            print(f"  {k:30s} {v!s:>12s}  {targets.get(k, '')}")


if __name__ == "__main__":
    main()
