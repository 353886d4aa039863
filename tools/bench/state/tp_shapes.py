"""Heterogeneous TP rooms against equal-TP rooms (issue 33 target 5): round trips per
batched step and Redis CPU per rank pair.

A room between a prefill of TP ``N`` and a decode of TP ``M`` has ``N`` senders and
``M`` receivers, routed by ``kvstate.tp`` (each decode rank reads each head it holds
from one prefill rank; idle prefill ranks get dummy routes). Its *rank pairs* are those
routes, dummies included: what the room moves between. Every rank runs the batched
step a scheduler runs (decode: ``init_many``, ``poll_many``, ``clear_many``; prefill:
``poll_many``, ``begin_many``, ``finish_many``, ``clear_many``), each rank with its own
KVManager and Store (own connection), state only (no transport: the control plane
alone). The shapes are alternated in rounds on one server, so load hits them alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

import kvstate
from kvstate.store import Store
from kvstate.testing import RedisCluster, RedisProcess, RoundTrips
from kvstate.tp import receivers_per_sender, routes
from tools.bench.state.redis_cost import RedisCost, primaries
from tools.bench.state.workload import HB, connect

KV_HEADS = 8
#: (prefill TP, decode TP); each heterogeneous shape is set against the equal-TP shape
#: with as many ranks on its larger side
SHAPES = [(2, 2), (4, 4), (2, 4), (4, 2), (1, 4), (4, 1)]


def baseline(shape: tuple[int, int]) -> tuple[int, int]:
    n = max(shape)
    return (n, n)


def label(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


class Room:
    """The ranks of one deployment shape: managers, their stores, the routes."""

    def __init__(self, stack: ExitStack, url: str, shape: tuple[int, int], tag: str) -> None:
        self.n, self.m = shape
        self.addr = f"10.33.{shape[0]}.{shape[1]}:8998"
        self.stores: list[Store] = []
        self.prefill = [self._mgr(stack, url, "prefill", f"{tag}-pf.tp{p}") for p in range(self.n)]
        self.decode = [self._mgr(stack, url, "decode", f"{tag}-dc.tp{d}") for d in range(self.m)]
        self.tag = tag
        self.routes = [routes(self.n, self.m, KV_HEADS, d) for d in range(self.m)]
        self.per_sender = receivers_per_sender(self.n, self.m, KV_HEADS)
        self.pairs = sum(len(r) for r in self.routes)

    def _mgr(self, stack: ExitStack, url: str, role: str, name: str) -> kvstate.KVManager:
        store = connect(url, "bench-tp")
        self.stores.append(store)
        stack.callback(store.close)
        addr = self.addr if role == "prefill" else None
        ranks = self.n if role == "prefill" else self.m
        mgr = kvstate.KVManager(store, role, name, addr, lease=HB, ranks=ranks)
        return stack.enter_context(mgr)

    def step(self, rooms: Sequence[int], pages: np.ndarray, trips: list[int]) -> None:
        """One batched step of ``rooms`` on every rank; ``trips`` gets each rank's round
        trips (prefill ranks first)."""

        def counted(i: int, fn: Any) -> Any:
            before = RoundTrips.count
            out = fn()
            trips[i] += RoundTrips.count - before
            return out

        for d, mgr in enumerate(self.decode):
            senders = {f"{self.tag}-pf.tp{p}": r for p, r in self.routes[d].items()}
            for room in rooms:
                mgr.receiver(room, self.addr, senders=senders, receivers_per_sender=self.per_sender)
            counted(self.n + d, lambda mgr=mgr: mgr.init_many(dict.fromkeys(rooms, pages)))
        for p, mgr in enumerate(self.prefill):
            for room in rooms:
                mgr.sender(room, required_receivers=None)
            # a sender that waits for as many receivers as they declare
            # (required_receivers=None, as vLLM's workers run every shape) learns the count
            # from the infos on its first poll and passes it on the next: two polls
            ready = counted(p, lambda mgr=mgr: mgr.poll_many(rooms))
            if set(ready.values()) == {kvstate.KVPoll.Bootstrapping}:
                ready = counted(p, lambda mgr=mgr: mgr.poll_many(rooms))
            assert set(ready.values()) == {kvstate.KVPoll.WaitingForInput}, ready
            counted(p, lambda mgr=mgr: mgr.begin_many(rooms))
            counted(p, lambda mgr=mgr: mgr.finish_many(rooms))
        for d, mgr in enumerate(self.decode):
            done = counted(self.n + d, lambda mgr=mgr: mgr.poll_many(rooms))
            assert set(done.values()) == {kvstate.KVPoll.Success}, (self.tag, done)
        for i, mgr in enumerate(self.prefill + self.decode):
            counted(i, lambda mgr=mgr: mgr.clear_many(rooms))


def tp_shapes(
    url: str,
    server: RedisProcess | RedisCluster,
    batch: int,
    rounds: int,
    shapes: Sequence[tuple[int, int]] = SHAPES,
) -> dict[str, Any]:
    """Per shape: round trips per batched step of each rank (the most and the fewest),
    Redis CPU and command us per room, per rank pair and per participant; each
    heterogeneous shape's ratios against its equal-TP baseline (targets: round trips
    per step 1.0, Redis CPU per rank pair <= 1.0)."""
    pages = np.arange(0, 256, dtype=np.int32)
    nodes = primaries(server)
    wanted = list(dict.fromkeys([*shapes, *(baseline(s) for s in shapes)]))
    cpu = dict.fromkeys(wanted, 0.0)
    cmd = dict.fromkeys(wanted, 0.0)
    trips: dict[tuple[int, int], list[int]] = {}
    took = dict.fromkeys(wanted, 0.0)
    out: dict[str, Any] = {"batch": batch, "rounds": rounds, "kv_heads": KV_HEADS}
    room = 5_000_000
    with ExitStack() as stack, RoundTrips.installed():
        rigs = {s: Room(stack, url, s, f"s{label(s)}") for s in wanted}
        for s, rig in rigs.items():  # warm: scripts loaded, connections open
            rig.step(range(room, room + batch), pages, [0] * (s[0] + s[1]))
            room += batch
        for r in range(rounds):
            order = wanted[r % len(wanted) :] + wanted[: r % len(wanted)]
            for s in order:
                counts = [0] * (s[0] + s[1])
                cost = RedisCost(nodes)
                with cost.measuring():
                    t0 = time.perf_counter()
                    rigs[s].step(range(room, room + batch), pages, counts)
                    took[s] += time.perf_counter() - t0
                room += batch
                cpu[s] += sum(cost.cpu_us)
                cmd[s] += sum(cost.cmd_us)
                trips.setdefault(s, counts)  # every round makes the same trips
                if counts != trips[s]:
                    raise AssertionError(f"{label(s)}: round trips moved {trips[s]} -> {counts}")
        pairs = {s: rigs[s].pairs for s in wanted}
    for c in nodes:
        c.close()
    rooms = batch * rounds
    for s in wanted:
        t = trips[s]
        out[label(s)] = {
            "prefill_tp": s[0],
            "decode_tp": s[1],
            "rank_pairs": pairs[s],
            "round_trips_per_step_prefill_rank": sorted(set(t[: s[0]])),
            "round_trips_per_step_decode_rank": sorted(set(t[s[0] :])),
            "round_trips_per_step_max_rank": max(t),
            "round_trips_per_step_all_ranks": sum(t),
            "redis_cpu_us_per_room": round(cpu[s] / rooms, 1),
            "redis_cmd_us_per_room": round(cmd[s] / rooms, 1),
            "redis_cpu_us_per_rank_pair": round(cpu[s] / rooms / pairs[s], 1),
            "redis_cpu_us_per_participant": round(cpu[s] / rooms / (s[0] + s[1]), 1),
            "rooms_per_s": round(rooms / took[s], 1),
        }
    ratios: dict[str, Any] = {}
    for s in shapes:
        b = baseline(s)
        if s == b:
            continue
        mine, base = out[label(s)], out[label(b)]
        ratios[f"{label(s)}_vs_{label(b)}"] = {
            "round_trips_per_step_max_rank": round(
                mine["round_trips_per_step_max_rank"] / base["round_trips_per_step_max_rank"], 3
            ),
            "redis_cpu_per_rank_pair": round(
                mine["redis_cpu_us_per_rank_pair"] / base["redis_cpu_us_per_rank_pair"], 3
            ),
            "redis_cpu_per_participant": round(
                mine["redis_cpu_us_per_participant"] / base["redis_cpu_us_per_participant"], 3
            ),
        }
    out["ratios"] = ratios
    out["targets"] = {
        "round_trips_per_step_max_rank": "1.0x the equal-TP room's",
        "redis_cpu_per_rank_pair": "<= 1.0x the equal-TP room's",
    }
    return out
