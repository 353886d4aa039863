#!/usr/bin/env python3
"""Redis round trips per SGLang scheduler step with kvstate's backend (issue 9 item 4).

SGLang polls every queued room on every rank every step. With kvstate's backend the
first poll of a step asks Redis about every live room of the rank at once (one
``poll_many``, one pipeline per Redis node); the rest of the step reads that answer.

For 0, 1, 64 and 256 rooms in flight this prints the round trips (counted at the
socket, as tools/bench_state.py does) of one prefill step and one decode step, each
polling every room through SGLang's own ``poll_and_all_reduce``, and the wall time a
step spends in it (median us), against the same step done with one kvstate poll per
room (the baseline), as ratios. Targets (issue 33 target 3): no round trip with nothing
in flight, one per Redis node per step otherwise.

Needs the [sglang] extra (SGLang 0.5.23 importable). State only (mirror mode): no KV
bytes move, so the count is the control plane alone.

    python tools/bench_sglang_steps.py [--rooms 0 1 64 256] [--steps 20] [--no-cluster]
                                       [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from kvstate.testing import RedisCluster, RedisProcess, RoundTrips

ADDR = "127.0.0.1:18998"


def _managers(url: str) -> tuple[Any, Any]:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.server_args import ServerArgs

    from kvstate.integrations.sglang import KVStateKVManager, Settings
    from kvstate.store import connect

    # a long lease keeps heartbeats out of the count
    settings = Settings(url=url, host="127.0.0.1", lease=600.0)
    args = KVArgs()
    args.engine_rank = 0
    args.system_dp_rank = 0

    def server(mode: str) -> Any:
        return ServerArgs(
            model_path="dummy",
            disaggregation_mode=mode,
            disaggregation_transfer_backend="kvstate",
            host="127.0.0.1",
            port=18000,
            disaggregation_bootstrap_port=18998,
        )

    p = KVStateKVManager(
        args,
        DisaggregationMode.PREFILL,
        server("prefill"),
        store=connect(url),
        settings=settings,
        mirror=True,
    )
    d = KVStateKVManager(
        args,
        DisaggregationMode.DECODE,
        server("decode"),
        store=connect(url),
        settings=settings,
        mirror=True,
    )
    assert d.try_ensure_parallel_info(ADDR)
    return p, d


def measure(url: str, rooms: int, steps: int, group: Any) -> dict[str, Any]:
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    from kvstate.integrations.sglang import KVStateKVReceiver, KVStateKVSender

    p, d = _managers(url)
    base = 50_000 + rooms * 1000
    rx = [KVStateKVReceiver(d, ADDR, base + i) for i in range(rooms)]
    tx = [KVStateKVSender(p, ADDR, base + i) for i in range(rooms)]
    for r in rx:
        r.init(0)
        r.send_metadata(np.arange(4), 0, None, 0)
    poll_and_all_reduce(tx, group)  # first step: everything created and published

    def step_trips(fn: Any) -> float:
        RoundTrips.count = 0
        with RoundTrips.installed():
            for _ in range(steps):
                fn()
        return RoundTrips.count / steps

    def step_us(fn: Any) -> float:
        took = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t0)
        return round(statistics.median(took) * 1e6, 1)

    prefill = lambda: poll_and_all_reduce(tx, group)  # noqa: E731
    decode = lambda: poll_and_all_reduce(rx, group)  # noqa: E731
    prefill_one = lambda: [t._part.poll() for t in tx]  # noqa: E731
    decode_one = lambda: [r._part.poll() for r in rx]  # noqa: E731
    out = {
        "rooms": rooms,
        "prefill_step": step_trips(prefill),
        "decode_step": step_trips(decode),
        "prefill_step_per_room_poll": step_trips(prefill_one),
        "decode_step_per_room_poll": step_trips(decode_one),
        "prefill_step_us": step_us(prefill),
        "decode_step_us": step_us(decode),
        "prefill_step_per_room_poll_us": step_us(prefill_one),
        "decode_step_per_room_poll_us": step_us(decode_one),
    }
    for side in ("prefill", "decode"):
        base = out[f"{side}_step_per_room_poll"]
        out[f"ratio_{side}"] = round(out[f"{side}_step"] / base, 4) if base else None
        base_us = out[f"{side}_step_per_room_poll_us"]
        out[f"ratio_{side}_us"] = round(out[f"{side}_step_us"] / base_us, 3) if rooms else None
    for part in (*tx, *rx):
        part.clear()
    p.close()
    d.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rooms", type=int, nargs="+", default=[0, 1, 64, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-primary cluster")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="0 1 4 rooms, 2 steps, no cluster (tests)")
    args = ap.parse_args()
    if args.smoke:
        args.rooms, args.steps, args.no_cluster = [0, 1, 4], 2, True
    load0 = os.getloadavg()
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    load_plugins()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'g')}", rank=0, world_size=1
        )
        group = dist.group.WORLD
        results: dict[str, Any] = {}
        with RedisProcess(port=0) as server:
            results["standalone (1 node)"] = [
                measure(server.url, n, args.steps, group) for n in args.rooms
            ]
        if not args.no_cluster:
            with RedisCluster(3, 0) as cluster:
                results["cluster (3 nodes)"] = [
                    measure(cluster.url, n, args.steps, group) for n in args.rooms
                ]
    results["loadavg"] = {
        "start": [round(x, 2) for x in load0],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    results["command"] = "python tools/bench_sglang_steps.py " + (
        "--smoke"
        if args.smoke
        else f"--rooms {' '.join(map(str, args.rooms))} --steps {args.steps}"
        + (" --no-cluster" if args.no_cluster else "")
    )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("round trips per scheduler step (every room polled once), target 1 per node")
    for name in ("standalone (1 node)", "cluster (3 nodes)"):
        print(f"[{name}]")
        print(f"  {'rooms':>6s} {'prefill':>8s} {'decode':>8s} {'per-room':>9s} {'us':>9s}")
        for r in results.get(name, []):
            print(
                f"  {r['rooms']:6d} {r['prefill_step']:8.2f} {r['decode_step']:8.2f} "
                f"{r['prefill_step_per_room_poll']:9.2f} {r['prefill_step_us']:9.1f}"
            )
    print(f"{results['command']}; load {results['loadavg']}")


if __name__ == "__main__":
    main()
