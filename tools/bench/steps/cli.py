"""The command line and the JSON document printed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import tools.bench.steps as package
from kvstate.testing import RedisProcess, RoundTrips
from tools.bench.steps import nixl
from tools.bench.steps.engine import LAYERS, write_model
from tools.bench.steps.vllm_steps import PHASES, measure, ratios, targets


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=package.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--counts", type=int, nargs="+", default=[0, 1, 64, 256])
    ap.add_argument("--steps", type=int, default=20, help="steps timed per steady phase")
    ap.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="each step's forward: ms the engine's thread waits without the GIL, as a "
        "worker waits for its device (what runs behind the step runs then); default 0",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help=f"attention layers of the model (default {LAYERS}): a KV cache each (K and V "
        "side by side), so a push writes (and plans) that many buffers",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="check that the tool runs (tests): counts 0 1 4, 2 steps; figures meaningless",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    counts, steps = ([0, 1, 4], 2) if args.smoke else (sorted(set(args.counts)), args.steps)
    logging.basicConfig(level=logging.ERROR)
    load0 = os.getloadavg()
    with (
        tempfile.TemporaryDirectory() as tmp,
        RedisProcess(port="auto") as server,
        RoundTrips.installed(),
    ):
        model = write_model(Path(tmp) / "model", args.layers)
        doc: dict[str, Any] = {"counts": counts, "steps_per_phase": steps, "phases": PHASES}
        doc["forward_ms"] = args.forward_ms
        doc["layers"] = args.layers
        doc["vllm"] = measure(server.url, model, counts, steps, args.forward_ms / 1000)
    doc["nixl_worker_side"] = nixl.available()  # else its scheduler side alone
    doc["ratios_kvstate_over_nixl"] = ratios(doc["vllm"], counts)
    doc["targets"] = targets(doc["vllm"], counts)
    doc["loadavg"] = {
        "start": [round(x, 2) for x in load0],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    run = f"--counts {' '.join(map(str, counts))} --steps {steps} --forward-ms {args.forward_ms:g}"
    if args.smoke:
        run = "--smoke"
    if args.layers != LAYERS:
        run += f" --layers {args.layers}"
    doc["command"] = "python tools/bench_vllm_steps.py " + run
    print(json.dumps(doc, indent=None if args.json else 2))
