"""The command line: the modes run, the JSON document or the text table, the exit status."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import tools.bench.transfer as package
from tools.bench.transfer.lanes import read as read_lanes
from tools.bench.transfer.plot import plot
from tools.bench.transfer.ratios import best_of, ratios_of
from tools.bench.transfer.timing import run_mode
from tools.bench.transfer.workload import Config, layouts
from transports.pages import merge_runs

# Set before any process starts: the spawned receivers and senders inherit them.
ENV_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Mooncake's TCP transport queues at most this many entries per peer (facts file).
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(package.__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument(
        "--cross-host",
        action="store_true",
        help="sender and receiver in two network namespaces over a veth pair",
    )
    ap.add_argument(
        "--plot", metavar="PNG", help="run same-host and cross-host and draw both (matplotlib)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=1024, help="pages per layer")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument(
        "--mooncake-lanes",
        default="1,2,4,8,16",
        help="comma list of MC_TCP_LANES_PER_PEER values: one Mooncake row each",
    )
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE,...",
        help="one more kvstate row with these environment variables, timed in turn with "
        "the rest (UCX path; KVSTATE_UCX_CMA=1 makes it a same-host CMA row), e.g. "
        "chunk0:KVSTATE_UCX_PUT_CHUNK=0; repeatable",
    )
    ap.add_argument(
        "--ucx-lanes",
        action="store_true",
        help="log which UCX transports each UCX user's endpoints used (UCX_LOG_LEVEL=info "
        "into files of the run) and print them (JSON: ucx_lanes)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of systems or kinds: kvstate-cma,kvstate-ucx,ucxx,ucxx-eh,nixl,"
        "nixl-eh,nixl-seg,nixl-eh-seg,mooncake,mooncake-N,socket,memcpy",
    )
    return ap


def print_table(doc: dict[str, Any], load0: float, load1: float) -> None:
    """The text report: one line per row, the ratios, each peer's best, the notes."""
    rows, ratios = doc["results"], doc["ratios"]
    print(
        f"\n{'mode':<11}{'system':<16}{'path':<5}{'case':<12}{'GB/s':>7}  "
        f"{'spread':<13}{'ms':>8}  verified"
    )
    for r in rows:
        spread = f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}"
        print(
            f"{r['mode']:<11}{r['system']:<16}{r['path']:<5}{r['case']:<12}"
            f"{r['gbps']:>7.2f}  {spread:<13}{r['median_ms']:>8.2f}  {r['verified']}"
        )
    print("\nratios of medians (each peer at its best setting in this run):")
    for key, val in ratios.items():
        print(f"  {key:<72} {'n/a' if val is None else f'{val:.2f}'}")
    for key, hit in best_of(rows).items():
        print(f"  best {key}: {hit['system']} ({hit['gbps']:.2f} GB/s)")
    for note in doc["notes"]:
        print(f"note: {note}")
    for mode, found in doc.get("ucx_lanes", {}).items():
        for key, configs in found.items():
            for c in configs or ["(no endpoint logged)"]:
                print(f"ucx lanes {mode} {key}: {c}")
    print(f"load average {load0:.2f} at start, {load1:.2f} at end; wall time {doc['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    for var, value in ENV_DEFAULTS.items():
        os.environ.setdefault(var, value)
    ap = parser()
    args = ap.parse_args(argv)
    lanes = [int(x) for x in args.mooncake_lanes.split(",") if x.strip()]
    extras = []
    for spec in args.extra:
        name, _, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if "=" in a)
        if not name or not env:
            ap.error(f"--extra {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
        extras.append((name, env))
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = sys.stdout
    if args.json:
        # Peers' C libraries (and their Python wrappers) log to stdout: send every write to
        # fd 1, ours and the spawned processes', to stderr and keep stdout for the document.
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    cfg = Config(args.layers, args.pages, args.page_kib * 1024, args.reps)
    skip = set(filter(None, args.skip.split(",")))
    say: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print

    cases = layouts(cfg)
    frag_runs = len(merge_runs(*cases["fragmented"]).length)
    load0 = os.getloadavg()
    say(
        f"{cfg.layers} layers x {cfg.pages} pages x {cfg.page_bytes // 1024} KiB = "
        f"{cfg.total_bytes / 2**20:.0f} MiB; fragmented: {frag_runs} runs per layer "
        f"({frag_runs * cfg.layers} in all); host {socket.gethostname()}, "
        f"{os.cpu_count()} CPUs, load {load0[0]:.2f}; median of {cfg.reps} after "
        f"{cfg.warmup} warm-up"
    )
    modes = (
        ["same-host", "cross-host"]
        if args.plot
        else ["cross-host"]
        if args.cross_host
        else ["same-host"]
    )
    started = time.perf_counter()
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    lanes_dir = tempfile.mkdtemp(prefix="kvstate-ucx-lanes-") if args.ucx_lanes else None
    for mode in modes:
        rows += run_mode(mode, cfg, cases, skip, lanes, tuple(extras), say, notes, lanes_dir)
    ratios, ratios_each = ratios_of(rows)
    load1 = os.getloadavg()
    if args.plot:
        notes.append(plot(rows, cfg, args.plot, load1[0]))
    doc = {
        "config": asdict(cfg)
        | {"total_bytes": cfg.total_bytes, "fragmented_runs_per_layer": frag_runs},
        "modes": modes,
        "results": rows,
        "ratios": ratios,
        "best": best_of(rows),
        "ratios_each_setting": ratios_each,
        "notes": notes,
        "loadavg": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if lanes_dir is not None:
        doc["ucx_lanes"] = read_lanes(lanes_dir)
        shutil.rmtree(lanes_dir, ignore_errors=True)
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
        out.flush()
    else:
        print_table(doc, load0[0], load1[0])
    return 0 if all(r["verified"] in (True, None) for r in rows) else 1
