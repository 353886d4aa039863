#!/usr/bin/env python3
"""What the UCX transport's plan costs a write, beside the copy it plans.

    python tools/bench_plan.py [--reps 200] [--json] [--smoke]

For each shape (buffers registered, pages a room moves, contiguous or fragmented, whole
pages or some KV heads of each), the median us of ``make_plans`` for one room to a
receiver on this host (its pairing kept between rooms, as the transport keeps it; and
made again, as for the first room to a receiver), and of the copy it plans
(``process_vm_writev`` of those bytes into this process: the baseline, measured in the
same run). A plan that costs more than its copy is the engine's Python, not the bytes,
setting the pace of a push. Figures depend on the host and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transports import cma  # noqa: E402
from transports.base import Geometry, Heads, Target  # noqa: E402
from transports.ucx.buffers import Region  # noqa: E402
from transports.ucx.pairing import LAYOUT_VERSION  # noqa: E402
from transports.ucx.plan import make_plans  # noqa: E402

PAGE = 256  # bytes of one page of one buffer (a block of a small model's layer)
HEADS = 4
# (buffers, pages a room moves, fragmented, heads written: None is the whole page)
SHAPES = [
    (2, 4, False, None),  # the steps benchmark's model, a short prompt
    (64, 4, False, None),  # a real model's layers (one buffer each), the same prompt
    (64, 64, True, None),  # a longer prompt in scattered blocks
    (64, 64, True, Heads(0, 0, HEADS // 2)),  # a decode of twice the TP: half the heads
    (160, 16, False, None),  # a deeper model
]


def _shape(buffers: int, pages: int) -> tuple[list[Region], list[np.ndarray], dict[str, Any]]:
    """Local buffers and a receiver's layout over buffers of this process (the copy's
    destination: it writes into itself), twice the pages a room moves, plus slack."""
    total = 2 * pages + 8
    geometry = [Geometry(f"layer.{i}", HEADS, 1) for i in range(buffers)]
    src = [np.full(total * PAGE, 1 + i % 251, dtype=np.uint8) for i in range(buffers)]
    dst = [np.zeros(total * PAGE, dtype=np.uint8) for _ in range(buffers)]
    regions = [
        Region(b, b.ctypes.data, b.nbytes, PAGE, total, "host", geometry=g)
        for b, g in zip(src, geometry, strict=True)
    ]
    me = cma.Identity.here()
    layout = {
        "transport": "ucx",
        "version": LAYOUT_VERSION,
        "id": me.as_dict(),
        "buffers": [
            {
                "addr": b.ctypes.data,
                "nbytes": b.nbytes,
                "page_bytes": PAGE,
                "num_pages": total,
                "memory": "host",
                "rkey": b"",
                "name": g.name,
                "heads": HEADS,
                "outer": 1,
            }
            for b, g in zip(dst, geometry, strict=True)
        ],
    }
    return regions, src + dst, layout


def _median_us(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def _row(
    buffers: int, pages: int, fragmented: bool, heads: Heads | None, reps: int
) -> dict[str, Any]:
    """One shape's figures."""
    regions, keep, layout = _shape(buffers, pages)
    rng = np.random.default_rng(buffers * 1000 + pages)
    if fragmented:
        src = rng.permutation(2 * pages)[:pages]
        dst = np.sort(rng.permutation(2 * pages)[:pages])
    else:
        src, dst = np.arange(pages), np.arange(pages, 2 * pages)
    target = Target(b"receiver", layout, dst, heads)
    me, pid = cma.Identity.here(), os.getpid()
    kept: dict[tuple[Any, ...], Any] = {}

    def plan(kept: dict[tuple[Any, ...], Any] | None) -> Any:
        return make_plans(1, src, [target], regions, me, (), 0, me, kept)[0]

    p = plan(kept)
    assert p.local_iov is not None and p.remote_iov is not None

    def copy() -> None:
        cma.write_runs(pid, p.local_iov, p.remote_iov, "this process", threads=1)

    row = {
        "buffers": buffers,
        "pages": pages,
        "fragmented": fragmented,
        "heads": None if heads is None else heads.count,
        "bytes": p.nbytes,
        "spans": int(p.local_iov.shape[0]),
        "plan_us": _median_us(lambda: plan(kept), reps),
        "plan_first_room_us": _median_us(lambda: plan(None), reps),
        "copy_us": _median_us(copy, reps),
    }
    row["plan_over_copy"] = round(row["plan_us"] / max(row["copy_us"], 0.1), 2)
    # the copy planned moved what it should: each buffer's fill into the pages (heads) named
    part = PAGE if heads is None else PAGE * heads.count // HEADS
    into = keep[buffers:]
    row["copied"] = all(
        (b.reshape(-1, PAGE)[dst, :part] == 1 + i % 251).all() for i, b in enumerate(into)
    )
    return row


def measure(reps: int) -> list[dict[str, Any]]:
    return [_row(*shape, reps) for shape in SHAPES]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=200, help="timed calls per figure")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--smoke", action="store_true", help="check the tool runs: 3 reps")
    args = ap.parse_args(argv)
    reps = 3 if args.smoke else args.reps
    load0 = os.getloadavg()
    rows = measure(reps)
    doc: dict[str, Any] = {
        "reps": reps,
        "rows": rows,
        "loadavg": {"start": round(load0[0], 2), "end": round(os.getloadavg()[0], 2)},
        "command": "python tools/bench_plan.py " + ("--smoke" if args.smoke else f"--reps {reps}"),
    }
    if args.json:
        print(json.dumps(doc))
        return
    print(
        f"{'buffers':>7} {'pages':>5} {'frag':>5} {'heads':>5} {'spans':>6} "
        f"{'plan us':>8} {'first':>8} {'copy us':>8} {'plan/copy':>9}"
    )
    for r in rows:
        print(
            f"{r['buffers']:>7} {r['pages']:>5} {str(r['fragmented']):>5} "
            f"{str(r['heads'] or '-'):>5} {r['spans']:>6} {r['plan_us']:>8} "
            f"{r['plan_first_room_us']:>8} {r['copy_us']:>8} {r['plan_over_copy']:>9}"
        )
    print(f"load {doc['loadavg']['start']} -> {doc['loadavg']['end']}; {doc['command']}")


if __name__ == "__main__":
    main()
