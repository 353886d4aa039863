#!/usr/bin/env python3
"""Control-plane benchmark (issue 12): what a room lifecycle costs the client and Redis.

One run, on private redis-servers it starts, prints (ratios are taken within the run,
so a busy machine moves them less than the absolute figures):

- the PING bound: redis-py ``ping()`` over a unix socket, and a raw ``PING`` over TCP
  (a plain socket, no client library), in round trips per second, sampled in each of
  8-20 rounds that alternate with the workload's (median and range);
- lifecycles/s, single (one room at a time: KVReceiver/KVSender calls) and batched
  (``--batch`` rooms per step: init_many, poll_many, begin_many, finish_many,
  clear_many), each against the bound = PING/s / round trips of one single lifecycle,
  as the median (and range) of the rounds' ratios, each round against its own PING
  sample (target: batched >= 1.0x per client process);
- Redis command us per lifecycle (INFO commandstats delta; target <= 100) and Redis CPU
  us per lifecycle (INFO cpu, used_cpu_sys + used_cpu_user delta);
- us per call of each script and of MULTI/EXEC (SLOWLOG at threshold 0, a separate pass);
- lifecycles/s that one primary sustains with 1, 2, 4 client processes (batched), the
  same on a 3-primary Cluster, and the scale-out ratio (target >= 2.5x): measured, and
  by Redis CPU (the busiest primary's CPU per lifecycle: what the Cluster could carry
  with clients enough, which a small machine cannot run);
- round trips per scheduler step (poll_many, begin_many, finish_many, clear_many of every
  in-flight room) with 1, 64 and 256 rooms in flight;
- Redis memory per in-flight room (4096 contiguous pages; target <= 1 KiB): the slope of
  INFO used_memory between 1,024 and 4,096 rooms held in WaitingForInput, with MEMORY
  USAGE of one room's keys beside it and the parts of the slope;
- durable mode (``?durable=true``: Success and aborts confirmed by a replica with WAIT)
  against plain mode on the same primaries with one replica each, alternated in the
  same run: round trips per lifecycle, Redis us per lifecycle (commands, and CPU of the
  primaries and of the replicas) and lifecycles/s, single and batched, as ratios;
- the room trace (``kvstate trace ROOM``) at 100%, at the default rate and off, on the
  same server in alternating rounds: round trips, Redis command us, CPU us and commands
  per lifecycle, Redis memory of one room's trace, lifecycles/s against off;
- the scripts by FCALL (the Redis 7 function library) against the EVAL path forced, on
  the same server in alternating rounds: Redis command and CPU us per lifecycle, single
  and batched, and FCALL / EVAL as the median of the rounds' ratios (``--eval`` forces
  the EVAL path for the whole run instead, to set against a run without it).

    python tools/bench_state.py [--quick] [--json] [--lifecycles 2000] [--batch 16]
                                [--procs 1 2 4] [--no-cluster] [--no-durable] [--no-trace]
                                [--no-fcall-vs-eval] [--eval]
                                [--rooms-per-step 16 256 4096 10000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

import kvstate
from kvstate.defaults import LEASE, TRACE_RATE
from kvstate.store import Store
from kvstate.store.functions import FUNCTIONS
from kvstate.store.scripts import SHAS
from kvstate.testing import RedisCluster, RedisProcess, RoundTrips

HB = 3600.0  # lease: keeps heartbeats out of the counts
_SCRIPT_OF = {sha: name for name, sha in SHAS.items()} | {f: n for n, f in FUNCTIONS.items()}
# Redis command time: a script's or EXEC's includes the commands it runs
_TOP = ("fcall", "evalsha", "eval", "exec")
_EVAL_ENV = "KVSTATE_BENCH_EVAL"  # --eval, for the worker processes too


# -- workloads ------------------------------------------------------------------------
def lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int, pages: np.ndarray) -> None:
    """One room, both sides, one call at a time (a poll each, both clears)."""
    rcv = d.receiver(room, p.bootstrap_addr)
    rcv.init(pages)
    snd = p.sender(room)
    assert snd.poll() == kvstate.KVPoll.WaitingForInput
    snd.begin_transfer()
    snd.finish_transfer()
    assert rcv.poll() == kvstate.KVPoll.Success
    snd.clear()
    rcv.clear()


def batch_lifecycles(
    p: kvstate.KVManager, d: kvstate.KVManager, rooms: Sequence[int], pages: np.ndarray
) -> None:
    """The same for many rooms at once, as an engine's scheduler step would."""
    for r in rooms:
        d.receiver(r, p.bootstrap_addr)
        p.sender(r)
    d.init_many(dict.fromkeys(rooms, pages))
    ready = p.poll_many(rooms)
    assert set(ready.values()) == {kvstate.KVPoll.WaitingForInput}, ready
    p.begin_many(rooms)
    p.finish_many(rooms)
    done = d.poll_many(rooms)
    assert set(done.values()) == {kvstate.KVPoll.Success}, done
    p.clear_many(rooms)
    d.clear_many(rooms)


@contextmanager
def pair(
    store: Store, worker: int = 0, lease: float = HB
) -> Iterator[tuple[kvstate.KVManager, kvstate.KVManager]]:
    """A prefill and a decode engine; each worker process its own (own address too)."""
    addr = f"10.0.{worker}.1:8998"
    with (
        kvstate.KVManager(store, "prefill", f"prefill-{worker}.tp0", addr, lease=lease) as p,
        kvstate.KVManager(store, "decode", f"decode-{worker}.tp0", lease=lease) as d,
    ):
        yield p, d


def connect(url: str, namespace: str, eval_only: bool = False, **kw: Any) -> Store:
    """kvstate.connect, on the EVAL path when asked (``eval_only``, or ``--eval``)."""
    if not (eval_only or os.environ.get(_EVAL_ENV) == "1"):
        return kvstate.connect(url, namespace=namespace, **kw)
    store = kvstate.connect(url, namespace=namespace, preload_scripts=False, **kw)
    store.eval_only = True
    store.load_scripts()
    return store


# -- Redis-side counters ----------------------------------------------------------------
def _primaries(server: RedisProcess | RedisCluster) -> list[redis.Redis]:
    if isinstance(server, RedisCluster):
        return [n.client() for n in server.nodes]
    return [server.client()]


class RedisCost:
    """INFO commandstats (usec) and INFO cpu deltas over a block, per primary."""

    def __init__(self, nodes: list[redis.Redis]) -> None:
        self.nodes = nodes
        self.cmd_us: list[float] = [0.0] * len(nodes)
        self.cpu_us: list[float] = [0.0] * len(nodes)
        self.calls: list[float] = [0.0] * len(nodes)
        self.scripts: list[float] = [0.0] * len(nodes)

    @staticmethod
    def _read(c: redis.Redis) -> tuple[float, float, float, float]:
        """(us in top-level calls, Redis CPU us, commands run, script calls); a script's
        or EXEC's time includes the commands it runs, so only FCALL, EVALSHA, EVAL and
        EXEC are summed for the time (kvstate's few plain top-level reads are left out)."""
        stats = c.info("commandstats")
        top = calls = scripts = 0.0
        for k, v in stats.items():
            name = k.split("_", 1)[1].split("|")[0]
            if name in ("info", "config", "slowlog", "ping", "script"):
                continue
            calls += float(v["calls"])
            if name in _TOP:
                top += float(v["usec"])
                scripts += float(v["calls"]) if name != "exec" else 0.0
        cpu = c.info("cpu")
        cpu_us = (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])) * 1e6
        return top, cpu_us, calls, scripts

    @contextmanager
    def measuring(self) -> Iterator[RedisCost]:
        before = [self._read(c) for c in self.nodes]
        yield self
        after = [self._read(c) for c in self.nodes]
        self.cmd_us = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        self.cpu_us = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        self.calls = [a[2] - b[2] for a, b in zip(after, before, strict=True)]
        self.scripts = [a[3] - b[3] for a, b in zip(after, before, strict=True)]


def script_costs(nodes: list[redis.Redis], run: Any) -> dict[str, float]:
    """Median us per call of each script (and MULTI/EXEC...) while ``run()`` runs, from
    SLOWLOG at threshold 0 (its own pass: the slowlog costs Redis time itself)."""
    saved: list[Any] = [c.config_get("slowlog-*") for c in nodes]
    for c in nodes:
        c.config_set("slowlog-log-slower-than", 0)
        c.config_set("slowlog-max-len", 100_000)
        c.slowlog_reset()
    try:
        run()
        entries = [e for c in nodes for e in c.execute_command("SLOWLOG", "GET", -1)]  # type: ignore[no-untyped-call]
    finally:
        for c, conf in zip(nodes, saved, strict=True):
            for k, v in conf.items():
                c.config_set(k, v)
    per: dict[str, list[int]] = {}
    for entry in entries:
        args = [a.decode("latin-1") if isinstance(a, bytes) else str(a) for a in entry[3]]
        name = args[0].lower()
        if name in ("fcall", "evalsha", "eval") and len(args) > 1:
            name = "eval" if name == "eval" else _SCRIPT_OF.get(args[1], args[1][:8])
        if name in ("slowlog", "config", "info", "ping", "client", "hello"):
            continue
        per.setdefault(name, []).append(int(entry[2]))
    # the median: on a shared machine a few calls descheduled mid-way skew a mean
    return {k: float(np.median(v)) for k, v in sorted(per.items())}


# -- bounds -----------------------------------------------------------------------------
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


# -- one deployment -----------------------------------------------------------------------
def measure(url: str, server: RedisProcess | RedisCluster, n: int, batch: int) -> dict[str, Any]:
    store = connect(url, "bench")
    nodes = _primaries(server)
    pages = np.arange(0, 4096, dtype=np.int32)
    out: dict[str, Any] = {}
    with pair(store) as (p, d):
        lifecycle(p, d, 0, pages)  # warm: scripts loaded, peers resolved
        batch_lifecycles(p, d, range(1, 1 + batch), pages)
        with RoundTrips.installed() as rt:
            before = rt.count
            lifecycle(p, d, 100, pages)
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
        mem = out["room_memory"] = held_room_memory(store, nodes, p, d, pages)
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
    """Round trips of one scheduler step's batched calls over every in-flight room."""
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
    nodes = _primaries(server)
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


# -- the PING bound, interleaved with the workload --------------------------------------------
def _add_cost(total: RedisCost, block: RedisCost) -> None:
    total.cmd_us = [a + b for a, b in zip(total.cmd_us, block.cmd_us, strict=True)]
    total.cpu_us = [a + b for a, b in zip(total.cpu_us, block.cpu_us, strict=True)]
    total.calls = [a + b for a, b in zip(total.calls, block.calls, strict=True)]
    total.scripts = [a + b for a, b in zip(total.scripts, block.scripts, strict=True)]


def _median_range(values: list[float], digits: int) -> tuple[float, list[float]]:
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
        _add_cost(totals["single"], block)
        with block.measuring():
            t0 = time.perf_counter()
            for _ in range(batches[r]):
                batch_lifecycles(p, d, range(broom, broom + batch), pages)
                broom += batch
            took["batched"].append(time.perf_counter() - t0)
        _add_cost(totals["batched"], block)
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
        out[key], out[f"{key}_range"] = _median_range(bounds[name], 1)
        for kind in ("single", "batched"):
            ratios = [
                (k / t) / (bound / trips)
                for k, t, bound in zip(done[kind], took[kind], bounds[name], strict=True)
                if k
            ]
            stem = f"{kind}_ratio_to_ping_bound_{name}"
            out[stem], out[f"{stem}_range"] = _median_range(ratios, 3)
    return out


# -- Redis memory per in-flight room ------------------------------------------------------------
HELD_ROOMS = (1024, 4096)
# Room ids of 19 digits, as engines draw them (random in [0, 2**63): the demo, SGLang):
# every per-room key name and the tracker's member carry the id.
HELD_ROOM_BASE = 2**62


def _settled_used_memory(c: redis.Redis) -> int:
    """INFO used_memory once the key dicts' incremental rehash is done: an expansion
    allocates the new bucket array at once and frees the old one only at the end (the
    server's cron finishes it in a few ticks), so the figure must hold still for 1 s."""
    last, still = -1, 0
    for _ in range(100):
        used = int(c.info("memory")["used_memory"])
        still = still + 1 if used == last else 0
        if still == 10:
            break
        last = used
        time.sleep(0.1)
    return last


def _memory_sample(store: Store, nodes: list[redis.Redis], tracker: str) -> dict[str, float]:
    """used_memory, the keyspace's hash tables (MEMORY STATS: dict entries and bucket
    arrays of the key and expiry dicts, the values' robj), the address tracker's MEMORY
    USAGE, the clients' buffers (in used_memory, not the rooms': noise) and the key
    count, summed over the primaries."""
    node: Any = store.client
    if store.cluster:
        node = node.get_node_from_key(tracker).redis_connection
    sample = {
        "used_memory": float(sum(_settled_used_memory(c) for c in nodes)),
        "client_buffers": float(sum(int(c.info("memory")["mem_clients_normal"]) for c in nodes)),
        "address_tracker": float(node.memory_usage(tracker, samples=0) or 0),
        "hashtables": 0.0,
        "keys": float(sum(int(c.dbsize()) for c in nodes)),
    }
    for c in nodes:
        db = c.memory_stats().get("db.0", {})
        sample["hashtables"] += float(db.get("overhead.hashtable.main", 0))
        sample["hashtables"] += float(db.get("overhead.hashtable.expires", 0))
    return sample


def held_room_memory(
    store: Store,
    nodes: list[redis.Redis],
    p: kvstate.KVManager,
    d: kvstate.KVManager,
    pages: np.ndarray,
    counts: tuple[int, int] = HELD_ROOMS,
) -> dict[str, Any]:
    """Redis memory per in-flight room as the slope of INFO used_memory between two
    counts of rooms held in WaitingForInput (both sides published, 4096 contiguous
    pages, 19-digit room ids), in one run: what the rooms cost the server. MEMORY
    USAGE of a room's keys (beside it) leaves out their expiry entries, the key dicts'
    buckets and the room's member of its address tracker. Beside the slope, those
    parts' own slopes and each key of one held room: MEMORY USAGE, encoding, fields.
    A room's trace (kept for the share Options.trace_rate of rooms) is in the slope at
    that share (keys_per_room shows it), listed with the keys when this room has one,
    and left out of the MEMORY USAGE sum, which is a room's state."""
    base, held = HELD_ROOM_BASE, 0
    samples: list[dict[str, float]] = []
    tracker = store.keys.addr(p.bootstrap_addr)
    for target in counts:
        while held < target:
            chunk = list(range(base + held, base + min(held + 256, target)))
            for r in chunk:
                d.receiver(r, p.bootstrap_addr)
                p.sender(r)
            d.init_many(dict.fromkeys(chunk, pages))
            ready = p.poll_many(chunk)
            assert set(ready.values()) == {kvstate.KVPoll.WaitingForInput}, ready
            held += len(chunk)
        samples.append(_memory_sample(store, nodes, tracker))
    keys: dict[str, dict[str, Any]] = {}
    for key in sorted(store.scan(store.keys.room_prefix(base) + "*")):
        node: Any = store.client
        if store.cluster:
            node = node.get_node_from_key(key).redis_connection
        parsed = store.keys.parse_room_key(key)
        keys[parsed.kind if parsed else key] = {
            "bytes": int(node.memory_usage(key, samples=0) or 0),
            "encoding": node.object("encoding", key).decode(),
            "fields": int(node.hlen(key)) if node.type(key) == b"hash" else None,
            "name_length": len(key),
        }
    for start in range(base, base + held, 256):
        chunk = list(range(start, min(start + 256, base + held)))
        p.clear_many(chunk)
        d.clear_many(chunk)
    lo, hi = samples
    rooms = counts[1] - counts[0]

    def slope(name: str) -> float:
        return round((hi[name] - lo[name]) / rooms, 1)

    return {
        "held_rooms": list(counts),
        "used_memory": [int(lo["used_memory"]), int(hi["used_memory"])],
        "used_memory_bytes_per_room": slope("used_memory"),
        "memory_usage_bytes_per_room": sum(v["bytes"] for k, v in keys.items() if k != "trace"),
        "keys_per_room": round((hi["keys"] - lo["keys"]) / rooms, 3),
        "key_and_expiry_dicts_bytes_per_room": slope("hashtables"),
        "address_tracker_bytes_per_room": slope("address_tracker"),
        "client_buffers_bytes_per_room": slope("client_buffers"),
        "keys": keys,
    }


# -- client processes -----------------------------------------------------------------------
def _worker(url: str, worker: int, rooms: int, batch: int, start: Any, done: Any) -> None:
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
    nodes = _primaries(server)
    out: dict[str, Any] = {}
    for k in counts:
        start, done = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(url, i + 1, rooms, batch, start, done))
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


# -- durable mode ---------------------------------------------------------------------------
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


def _redis_us(nodes: list[redis.Redis]) -> tuple[float, float]:
    """(us in top-level calls, WAIT's included; Redis CPU us), summed over ``nodes``."""
    cmd = cpu = 0.0
    for c in nodes:
        for k, v in c.info("commandstats").items():
            if k.split("_", 1)[1].split("|")[0] in (*_TOP, "wait"):
                cmd += float(v["usec"])
        info = c.info("cpu")
        cpu += (float(info["used_cpu_sys"]) + float(info["used_cpu_user"])) * 1e6
    return cmd, cpu


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
            with RoundTrips.installed() as rt:
                before = rt.count
                lifecycle(p, d, 1, pages)
                out[f"{mode}_round_trips_per_lifecycle"] = rt.count - before
        room = 1000
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                p, d = engines[mode]
                cmd0, cpu0 = _redis_us(primaries)
                rcpu0 = _redis_us(replicas)[1]
                t0 = time.perf_counter()
                for _ in range(single):
                    lifecycle(p, d, room, pages)
                    room += 1
                t1 = time.perf_counter()
                for _ in range(batches):
                    batch_lifecycles(p, d, range(room, room + batch), pages)
                    room += batch
                t2 = time.perf_counter()
                cmd1, cpu1 = _redis_us(primaries)
                took[mode]["single"].append(t1 - t0)
                took[mode]["batched"].append(t2 - t1)
                spent[mode]["redis_cmd_us"] += cmd1 - cmd0
                spent[mode]["redis_cpu_us"] += cpu1 - cpu0
                spent[mode]["replica_cpu_us"] += _redis_us(replicas)[1] - rcpu0
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


# -- the room trace ------------------------------------------------------------------------
TRACE_MODES = {"off": 0.0, "default": TRACE_RATE, "full": 1.0}


def trace_cost(url: str, server: RedisProcess | RedisCluster, n: int, batch: int) -> dict[str, Any]:
    """The trace off, at the default rate and on every room (100%), on one deployment
    in many short rounds that each run all three (the order rotated): per lifecycle,
    round trips, Redis command us (scripts + EXEC), Redis CPU us, commands run;
    lifecycles/s against off as the median of the rounds' ratios; the Redis memory of
    one room's trace once cleared (what a traced room leaves for its trace TTL)."""
    pages = np.arange(0, 4096, dtype=np.int32)
    nodes = _primaries(server)
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
            with RoundTrips.installed() as rt:
                before = rt.count
                lifecycle(p, d, 1, pages)
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


def fcall_vs_eval(url: str, server: RedisProcess, n: int, batch: int) -> dict[str, Any]:
    """The scripts by FCALL (the library, Redis 7) and by EVALSHA (the EVAL path forced)
    on the same server, in short rounds that each run both (each first in half of
    them): Redis command and CPU us per lifecycle, single and batched, and FCALL / EVAL
    as the median of the rounds' ratios (a load swing moves a round, not the median)."""
    pages = np.arange(0, 4096, dtype=np.int32)
    nodes = _primaries(server)
    modes = ("fcall", "eval")
    stores = {m: connect(url, f"bench-{m}", eval_only=m == "eval") for m in modes}
    rounds = max(10, min(20, n // 100))
    single, batches = max(n // rounds, 1), max(n // rounds // batch, 1)
    kinds = ("single", "batched")
    per = {m: {k: {"cmd": [], "cpu": []} for k in kinds} for m in modes}  # per round
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
            out[ratio], out[f"{ratio}_range"] = _median_range(
                [a / b for a, b in zip(f, e, strict=True) if b], 3
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--quick", action="store_true", help="small counts (CI, tests)")
    ap.add_argument("--lifecycles", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16, help="rooms per batched step")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-primary cluster run")
    ap.add_argument("--no-durable", action="store_true", help="skip durable mode's cost")
    ap.add_argument("--no-trace", action="store_true", help="skip the room trace's cost")
    ap.add_argument(
        "--no-fcall-vs-eval", action="store_true", help="skip FCALL against the EVAL path"
    )
    ap.add_argument(
        "--eval", action="store_true", help="every store on the EVAL path (EVALSHA), as on 6.2"
    )
    ap.add_argument(
        "--rooms-per-step",
        type=int,
        nargs="+",
        metavar="N",
        help="only batched steps of N rooms each (e.g. 16 256 4096 10000): round trips per "
        "step and Redis us per lifecycle, standalone (and Cluster unless --no-cluster)",
    )
    args = ap.parse_args()
    if args.eval:
        os.environ[_EVAL_ENV] = "1"
    if args.rooms_per_step:
        steps: dict[str, Any] = {}
        with RedisProcess(port="auto") as server:
            steps["standalone"] = rooms_per_step(server.url, server, args.rooms_per_step)
        if not args.no_cluster:
            with RedisCluster(3, 0) as cluster:
                steps["cluster3"] = rooms_per_step(cluster.url, cluster, args.rooms_per_step)
        steps["command"] = (
            "python tools/bench_state.py --rooms-per-step "
            + " ".join(map(str, args.rooms_per_step))
            + (" --no-cluster" if args.no_cluster else "")
        )
        print(json.dumps(steps, indent=None if args.json else 2))
        return
    n, procs = args.lifecycles, args.procs
    if args.quick:
        n, procs = min(n, 160), [p for p in procs if p <= 2]
    per_proc = max(n // 2, args.batch)
    results: dict[str, Any] = {}
    with RedisProcess(port="auto") as server:
        res = measure(server.url, server, n, args.batch)
        res["processes"] = processes(server.url, server, procs, per_proc, args.batch)
        results["standalone"] = res
    if not args.no_cluster:
        with RedisCluster(3, 0) as cluster:
            res = measure(cluster.url, cluster, max(n // 2, 2 * args.batch), args.batch)
            res["processes"] = processes(cluster.url, cluster, procs, per_proc, args.batch)
            results["cluster3"] = res
        one, three = results["standalone"]["processes"], results["cluster3"]["processes"]
        top = f"{max(procs)}_procs"
        results["scale_out_3_vs_1"] = {
            "measured": round(three[top]["lifecycles_per_s"] / one[top]["lifecycles_per_s"], 2),
            "by_busiest_primary_cpu": round(
                one[top]["busiest_primary_cpu_us_per_lifecycle"]
                / three[top]["busiest_primary_cpu_us_per_lifecycle"],
                2,
            ),
        }
    if not args.no_fcall_vs_eval and not args.eval:
        with RedisProcess(port="auto") as server:
            results["fcall_vs_eval"] = fcall_vs_eval(server.url, server, n, args.batch)
    if not args.no_durable:
        results["durable"] = durable_runs(n, args.batch, not args.no_cluster)
    if not args.no_trace:
        results["trace"] = {}
        with RedisProcess(port="auto") as server:
            results["trace"]["standalone"] = trace_cost(server.url, server, n, args.batch)
        if not args.no_cluster:
            with RedisCluster(3, 0) as cluster:
                results["trace"]["cluster3"] = trace_cost(
                    cluster.url, cluster, max(n // 2, 3 * args.batch), args.batch
                )
    flags = ("--quick" if args.quick else "", f"--lifecycles {args.lifecycles}")
    flags += ("--eval" if args.eval else "",)
    results["command"] = "python tools/bench_state.py " + " ".join(a for a in flags if a)
    print(json.dumps(results, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
