"""Engine pairs (issue 33 target 2): many engine pairs on a 3-primary Cluster against one
standalone server, in the same run.

One client process per engine pair (a prefill and a decode manager, an address of its
own: ``10.0.<i>.1:8998``), each connected to every deployment at once; the rounds run
every pair's batched lifecycles on one deployment at a time, the deployments' order
rotated round by round, so a busy machine weighs on each alike. Per deployment: Redis
CPU us per lifecycle (INFO cpu delta) of each primary, their sum, the busiest against
the primaries' mean, and the per-round ratios the issue asks for (scale-out by the
busiest primary's CPU, the Cluster's total against one server's). The standalone server
is measured over TCP (the Cluster's transport: loopback TCP costs Redis more CPU than a
unix socket) and over its unix socket beside it; a one-node Cluster (cluster mode on, every
slot on one primary) tells the cost of cluster mode itself from that of a step split
over three primaries (one round trip per node, each with a third of the rooms), and the
same 3-primary Cluster with every pair's keys on one of its primaries (``cluster3_one``:
rooms and addresses picked by where their keys land) tells that split from the nodes
merely being there (their cron, the PUBLISH of a change notice broadcast to each). Memory
per room is the INFO used_memory slope of ``memory.held_room_memory`` on each deployment.

Where each pair's per-engine keys land is printed: its address index
(``engines_at:<addr>``, which the receivers' first step reads once per batch on a
Cluster) and the shards of its address tracker (``addr:<addr>#<n>``, which every
receiver's create and clear write; one sorted set per address before issue 33).
``placement="spread"`` picks each pair's port so that the indexes spread evenly over
the primaries (what an operator who chooses the addresses, or moves the slots,
controls); ``"named"`` takes the addresses as they come.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from kvstate.keys import Keys
from kvstate.store import Store
from kvstate.testing import RedisCluster, RedisProcess
from kvstate.testing.process import free_port_pair
from tools.bench.state.memory import HELD_ROOMS, held_room_memory
from tools.bench.state.redis_cost import RedisCost, primaries
from tools.bench.state.workload import batch_lifecycles, connect, pair

NAMESPACE = "bench"


ONE = "cluster3_one"  # the 3-primary Cluster, every key of the run on one primary


def _rooms(store: Store, addr: str, n: int, primary: str | None) -> list[int]:
    """``n`` room ids from 1000 up; with ``primary``, only those whose room keys and
    address tracker shard live on it (picked before the rounds: no client cost in them)."""
    if primary is None:
        return list(range(1000, 1000 + n))
    client: Any = store.client

    def on_primary(room: int) -> bool:
        keys = (store.keys.room_hash(room), store.keys.tracker(addr, room))
        return all(client.get_node_from_key(k).name == primary for k in keys)

    return list(itertools.islice(filter(on_primary, itertools.count(1000)), n))


def _worker(
    urls: dict[str, str],
    addrs: dict[str, str],
    primary: str,
    worker: int,
    batch: int,
    lifecycles: int,
    cmd: Any,
    done: Any,
) -> None:
    """One engine pair per deployment (spawned): warm, ready, then rounds on command."""
    pages = np.arange(0, 4096, dtype=np.int32)
    with ExitStack() as stack:
        pairs, rooms = {}, {}
        for name, url in urls.items():
            store = connect(url, f"{NAMESPACE}-{name}")
            stack.callback(store.close)
            pairs[name] = stack.enter_context(pair(store, worker, addr=addrs[name]))
            todo = _rooms(store, addrs[name], batch + lifecycles, primary if name == ONE else None)
            rooms[name] = iter([todo[i : i + batch] for i in range(0, len(todo), batch)])
        for name, (p, d) in pairs.items():
            batch_lifecycles(p, d, next(rooms[name]), pages)  # warm: scripts, peers resolved
        done.put(None)
        while (msg := cmd.get()) is not None:
            name, steps = msg
            p, d = pairs[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                batch_lifecycles(p, d, next(rooms[name]), pages)
            done.put((steps * batch, time.perf_counter() - t0))


@contextmanager
def one_node_cluster() -> Iterator[RedisProcess]:
    """A Cluster of one primary holding every slot (``redis-cli --cluster create`` wants
    three): cluster mode's own cost, with no step split over nodes."""
    directory = tempfile.mkdtemp(prefix="kvstate-cluster1-")
    node = RedisProcess(
        directory,
        unix_socket=False,
        port=free_port_pair(),
        extra_args=["--cluster-enabled", "yes", "--cluster-config-file", f"{directory}/n.conf"],
    )
    try:
        node.start()
        with node.client() as c:
            c.execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 30
            while "cluster_state:ok" not in _text(c.execute_command("CLUSTER INFO")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the one-node Cluster did not come up")
                time.sleep(0.1)
        yield node
    finally:
        node.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _text(info: Any) -> str:
    if isinstance(info, dict):
        return "\n".join(f"{k}:{v}" for k, v in info.items())
    return info.decode() if isinstance(info, bytes) else str(info)


def addresses(
    cluster: RedisCluster, count: int, placement: str, namespace: str = f"{NAMESPACE}-cluster3"
) -> tuple[list[str], list[int], list[int]]:
    """Each pair's bootstrap address, the primary its address index lands on (index into
    ``cluster.primaries()``), and how many of all pairs' tracker shards each primary
    serves: ``named``, 10.0.<i>.1:8998 as they come; ``spread``, the first port from
    8998 up whose index lands on primary i % 3; ``one``, on primary 0."""
    keys = Keys(namespace)
    ports = [n.port for n in cluster.primaries()]
    addrs: list[str] = []
    nodes: list[int] = []
    shards = [0] * len(ports)
    with cluster.primaries()[0].client() as c:
        ranges = [
            (int(start), int(end), ports.index(int(master[1])))
            for start, end, master, *_ in c.execute_command("CLUSTER SLOTS")
        ]

        def node_of(key: str) -> int:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            return next(i for lo, hi, i in ranges if lo <= slot <= hi)

        for i in range(1, count + 1):
            port = 8998
            addr = f"10.0.{i}.1:{port}"
            if placement in ("spread", "one"):
                want = (i - 1) % len(ports) if placement == "spread" else 0
                while node_of(keys.engines_at(addr)) != want:
                    port += 1
                    addr = f"10.0.{i}.1:{port}"
            addrs.append(addr)
            nodes.append(node_of(keys.engines_at(addr)))
            for tracker in keys.trackers(addr):
                shards[node_of(tracker)] += 1
    return addrs, nodes, shards


def _summary(costs: list[RedisCost], counts: list[int], walls: list[float]) -> dict[str, Any]:
    total = sum(counts)
    per_node = [sum(c.cpu_us[i] for c in costs) / total for i in range(len(costs[0].cpu_us))]
    mean = statistics.fmean(per_node)
    return {
        "lifecycles": total,
        "lifecycles_per_s": round(total / sum(walls), 1),
        "redis_cpu_us_per_lifecycle": round(sum(per_node), 1),
        "redis_cmd_us_per_lifecycle": round(sum(sum(c.cmd_us) for c in costs) / total, 1),
        "primary_cpu_us_per_lifecycle": [round(v, 1) for v in per_node],
        "busiest_primary_cpu_us_per_lifecycle": round(max(per_node), 1),
        "busiest_over_mean": round(max(per_node) / mean, 3),
    }


def _median_range(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 3),
        "range": [round(min(values), 3), round(max(values), 3)],
    }


def engine_pairs(
    count: int,
    batch: int,
    rounds: int,
    steps: int,
    placement: str = "named",
    held: tuple[int, int] = HELD_ROOMS,
) -> dict[str, Any]:
    """``count`` engine pairs, ``rounds`` rounds per deployment of ``steps`` batched
    steps of ``batch`` rooms per pair; the figures and ratios (module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {
        "pairs": count,
        "batch": batch,
        "rounds": rounds,
        "lifecycles_per_round": count * steps * batch,
        "placement": placement,
    }
    with (
        RedisProcess(port="auto") as server,
        RedisCluster(3, 0) as cluster,
        one_node_cluster() as single,
    ):
        assert server.unix_socket is not None
        urls = {
            "standalone_tcp": server.tcp_url,
            "standalone_unix": server.unix_url,
            "cluster1": f"redis+cluster://{single.host}:{single.port}",
            "cluster3": cluster.url,
            ONE: cluster.url,
        }
        nodes = {
            "standalone_tcp": primaries(server),
            "standalone_unix": primaries(server),
            "cluster1": primaries(single),
            "cluster3": primaries(cluster),
            ONE: primaries(cluster),
        }
        addrs, index_nodes, shards = addresses(cluster, count, placement)
        ones = addresses(cluster, count, "one", f"{NAMESPACE}-{ONE}")[0]
        primary = cluster.primaries()[0]
        out["index_primary_of_each_pair"] = index_nodes
        out["indexes_per_primary"] = [index_nodes.count(i) for i in range(3)]
        out["tracker_shards_per_primary"] = shards
        cmds = [ctx.Queue() for _ in range(count)]
        done = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    urls,
                    {name: ones[i] if name == ONE else addrs[i] for name in urls},
                    f"{primary.host}:{primary.port}",
                    i + 1,
                    batch,
                    rounds * steps * batch,
                    cmds[i],
                    done,
                ),
            )
            for i in range(count)
        ]
        for pr in procs:
            pr.start()
        try:
            for _ in procs:
                done.get(timeout=300)
            per: dict[str, tuple[list[RedisCost], list[int], list[float]]] = {
                name: ([], [], []) for name in urls
            }
            names = list(urls)
            loads = [os.getloadavg()[0]]
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    cost = RedisCost(nodes[name])
                    with cost.measuring():
                        t0 = time.perf_counter()
                        for q in cmds:
                            q.put((name, steps))
                        got = [done.get(timeout=600) for _ in procs]
                        wall = time.perf_counter() - t0
                    per[name][0].append(cost)
                    per[name][1].append(sum(g[0] for g in got))
                    per[name][2].append(wall)
                loads.append(os.getloadavg()[0])
            for q in cmds:
                q.put(None)
            for pr in procs:
                pr.join(30)
        finally:
            for pr in procs:
                if pr.is_alive():
                    pr.kill()
        for name in names:
            out[name] = _summary(*per[name])

        def ratio(fn: Any) -> dict[str, Any]:
            return _median_range([fn(r) for r in range(rounds)])

        def cpu(name: str, r: int) -> float:
            return sum(per[name][0][r].cpu_us) / per[name][1][r]

        def busiest(r: int) -> float:
            return max(per["cluster3"][0][r].cpu_us) / per["cluster3"][1][r]

        def balance(r: int) -> float:
            c = per["cluster3"][0][r].cpu_us
            return max(c) / statistics.fmean(c)

        out["ratios"] = {
            "cluster_busiest_over_mean": ratio(balance),
            "scale_out_by_busiest_primary_cpu_vs_standalone_tcp": ratio(
                lambda r: cpu("standalone_tcp", r) / busiest(r)
            ),
            "scale_out_by_busiest_primary_cpu_vs_standalone_unix": ratio(
                lambda r: cpu("standalone_unix", r) / busiest(r)
            ),
            "cluster_total_cpu_over_standalone_tcp": ratio(
                lambda r: cpu("cluster3", r) / cpu("standalone_tcp", r)
            ),
            "cluster_total_cpu_over_standalone_unix": ratio(
                lambda r: cpu("cluster3", r) / cpu("standalone_unix", r)
            ),
            "one_node_cluster_cpu_over_standalone_tcp": ratio(
                lambda r: cpu("cluster1", r) / cpu("standalone_tcp", r)
            ),
            "cluster_on_one_primary_cpu_over_standalone_tcp": ratio(
                lambda r: cpu(ONE, r) / cpu("standalone_tcp", r)
            ),
            "cluster_total_cpu_over_cluster_on_one_primary": ratio(
                lambda r: cpu("cluster3", r) / cpu(ONE, r)
            ),
        }
        out["load_1min"] = [round(v, 2) for v in (min(loads), max(loads))]
        pages = np.arange(0, 4096, dtype=np.int32)
        for name in ("standalone_tcp", "cluster3"):
            store = connect(urls[name], f"{NAMESPACE}-mem")
            with pair(store, 0) as (p, d):
                batch_lifecycles(p, d, range(batch), pages)
                mem = held_room_memory(store, nodes[name], p, d, pages, held)
            store.close()
            out[name]["room_memory_bytes"] = mem["used_memory_bytes_per_room"]
            out[name]["room_memory_usage_bytes"] = mem["memory_usage_bytes_per_room"]
            out[name]["address_tracker_bytes_per_room"] = mem["address_tracker_bytes_per_room"]
        for clients in nodes.values():
            for c in clients:
                c.close()
    return out
