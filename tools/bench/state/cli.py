"""The command line: which parts run, at which counts, and the JSON document printed."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import tools.bench.state as package
from kvstate.testing import RedisCluster, RedisProcess
from tools.bench.state.deployment import measure, rooms_per_step
from tools.bench.state.durable import durable_runs
from tools.bench.state.fcall import fcall_vs_eval
from tools.bench.state.memory import HELD_ROOMS
from tools.bench.state.pairs import engine_pairs
from tools.bench.state.procs import processes
from tools.bench.state.tp_shapes import tp_shapes
from tools.bench.state.trace import trace_cost
from tools.bench.state.workload import EVAL_ENV

SMOKE_LIFECYCLES = 20
SMOKE_HELD_ROOMS = (64, 256)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=package.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--quick", action="store_true", help="small counts (CI, tests)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check that the tool runs, in seconds (tests): 20 lifecycles, one client "
        "process, 64 and 256 held rooms; its figures mean nothing",
    )
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
    ap.add_argument(
        "--tp-shapes",
        action="store_true",
        help="only rooms of heterogeneous TP (prefill x decode ranks: 2x4, 4x2, 1x4, 4x1) "
        "against equal-TP rooms (2x2, 4x4): round trips per batched step of each rank and "
        "Redis CPU per rank pair, with ratios (standalone; --batch rooms per step)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        metavar="N",
        help="only N engine pairs (one client process each) on a 3-primary Cluster against "
        "one standalone server, in alternating rounds (issue 33): Redis CPU per lifecycle "
        "per primary, busiest / mean, scale-out, Cluster / standalone, memory per room",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help="alternated rounds: --tp-shapes (default 30), --pairs (per deployment, default 6)",
    )
    ap.add_argument(
        "--placement",
        choices=("named", "spread"),
        default="named",
        help="--pairs: the pairs' addresses as named (10.0.<i>.1:8998), or ports picked so "
        "that their address trackers spread evenly over the primaries",
    )
    return ap


def shapes_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--tp-shapes``: heterogeneous TP rooms against equal-TP ones, one server."""
    args.rounds = args.rounds or 30
    rounds = 2 if args.smoke else args.rounds
    batch = 4 if args.smoke else args.batch
    with RedisProcess(port="auto") as server:
        out = tp_shapes(server.url, server, batch, rounds)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    out["command"] = "python tools/bench_state.py --tp-shapes" + (
        " --smoke" if args.smoke else f" --batch {args.batch} --rounds {args.rounds}"
    )
    return out


def pairs_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--pairs N``: engine pairs on the Cluster against a standalone server."""
    args.rounds = args.rounds or 6
    steps, rounds, held = (
        max(args.lifecycles // (args.pairs * args.batch), 1),
        args.rounds,
        HELD_ROOMS,
    )
    if args.smoke:
        steps, rounds, held = 1, 2, SMOKE_HELD_ROOMS
    doc = engine_pairs(args.pairs, args.batch, rounds, steps, args.placement, held)
    doc["command"] = (
        f"python tools/bench_state.py --pairs {args.pairs} --rounds {args.rounds} "
        f"--lifecycles {args.lifecycles} --batch {args.batch} --placement {args.placement}"
        + (" --smoke" if args.smoke else "")
    )
    return doc


def steps_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--rooms-per-step``: only steps of many rooms, standalone and Cluster."""
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
    return steps


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.eval:
        os.environ[EVAL_ENV] = "1"
    if args.tp_shapes:
        print(json.dumps(shapes_only(args), indent=None if args.json else 2))
        return
    if args.rooms_per_step:
        print(json.dumps(steps_only(args), indent=None if args.json else 2))
        return
    if args.pairs:
        print(json.dumps(pairs_only(args), indent=None if args.json else 2))
        return
    n, procs, held = args.lifecycles, args.procs, HELD_ROOMS
    if args.quick:
        n, procs = min(n, 160), [p for p in procs if p <= 2]
    if args.smoke:
        n, procs, held = min(n, SMOKE_LIFECYCLES), [min(procs)], SMOKE_HELD_ROOMS
    per_proc = max(n // 2, args.batch)
    results: dict[str, Any] = {}
    with RedisProcess(port="auto") as server:
        res = measure(server.url, server, n, args.batch, held)
        res["processes"] = processes(server.url, server, procs, per_proc, args.batch)
        results["standalone"] = res
    if not args.no_cluster:
        with RedisCluster(3, 0) as cluster:
            res = measure(cluster.url, cluster, max(n // 2, 2 * args.batch), args.batch, held)
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
    flags = [
        "--quick" if args.quick else "",
        "--smoke" if args.smoke else "",
        f"--lifecycles {args.lifecycles}",
        "--eval" if args.eval else "",
    ]
    results["command"] = "python tools/bench_state.py " + " ".join(a for a in flags if a)
    print(json.dumps(results, indent=None if args.json else 2))
