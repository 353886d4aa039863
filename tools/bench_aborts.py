#!/usr/bin/env python3
"""What giving up on many rooms costs: ``KVManager.abort_many`` against an ``abort()``
per room (the baseline, measured in the same run), and a restarted rank's
``clear_predecessor``, on a redis-server of its own.

    python tools/bench_aborts.py [--counts 1 64 256] [--reps 3] [--json] [--smoke]

For each count: the rooms' senders and receivers made and published (WaitingForInput),
then failed one way or the other (alternated, ``--reps`` times each); the median ms and
the round trips of each way, and one by one over abort_many. Then a decode rank that
left that many receivers restarts under its name: the round trips and ms of its
``clear_predecessor``. Figures depend on the host and its load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstate  # noqa: E402
from kvstate.testing import RedisProcess, RoundTrips  # noqa: E402

PREFILL, DECODE = ("prefill-a.tp0", "10.0.0.1:8998"), ("decode-b.tp0", "10.0.0.2:8998")
_rooms = itertools.count(1)


def waiting(p: kvstate.KVManager, d: kvstate.KVManager, n: int) -> list[kvstate.KVSender]:
    """The senders of ``n`` rooms whose decode published: WaitingForInput."""
    senders = [p.sender(next(_rooms)) for _ in range(n)]
    rooms = [s.room for s in senders]
    for r in rooms:
        d.receiver(r, PREFILL[1])
    d.init_many({r: np.arange(4) for r in rooms})
    p.poll_many(rooms)
    return senders


def timed(call: Any) -> tuple[float, int]:
    """(ms, round trips of this thread) of ``call()``."""
    before = RoundTrips.by_thread["MainThread"]
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1000, RoundTrips.by_thread["MainThread"] - before


def aborts(store: kvstate.Store, n: int, reps: int) -> dict[str, Any]:
    """One by one against abort_many, alternated."""
    ways: dict[str, list[tuple[float, int]]] = {"one_by_one": [], "abort_many": []}
    with (
        kvstate.KVManager(store, "prefill", *PREFILL, lease=60.0) as p,
        kvstate.KVManager(store, "decode", *DECODE, lease=60.0) as d,
    ):
        for _ in range(reps):
            for way, got in ways.items():
                senders = waiting(p, d, n)
                rooms = [s.room for s in senders]
                if way == "one_by_one":
                    got.append(timed(lambda ss=senders: [s.abort("stop") for s in ss]))
                else:
                    got.append(timed(lambda rs=rooms: p.abort_many(dict.fromkeys(rs, "stop"))))
                p.clear_many(rooms)
                d.clear_many(rooms)
    out: dict[str, Any] = {"rooms": n}
    for way, got in ways.items():
        out[f"{way}_ms"] = round(statistics.median(ms for ms, _ in got), 3)
        out[f"{way}_round_trips"] = max(trips for _, trips in got)
    out["one_by_one_over_abort_many"] = round(out["one_by_one_ms"] / out["abort_many_ms"], 2)
    return out


def predecessor(store: kvstate.Store, n: int) -> dict[str, Any]:
    """A decode rank that left ``n`` receivers (closed without clearing them: as good as
    killed, for them) restarts under its name."""
    with kvstate.KVManager(store, "prefill", *PREFILL, lease=60.0) as p:
        with kvstate.KVManager(store, "decode", *DECODE, lease=60.0) as d:
            rooms = [s.room for s in waiting(p, d, n)]
        with kvstate.KVManager(store, "decode", *DECODE, lease=60.0) as again:
            found: list[int] = []
            ms, trips = timed(lambda: found.extend(again.clear_predecessor()))
        p.clear_many(rooms)
    return {"rooms": n, "cleared": len(found), "ms": round(ms, 3), "round_trips": trips}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--smoke", action="store_true", help="counts 1 4, one rep (tests)")
    args = ap.parse_args(argv)
    counts, reps = ([1, 4], 1) if args.smoke else (args.counts, args.reps)
    with (
        tempfile.TemporaryDirectory() as tmp,
        RedisProcess(Path(tmp) / "redis", port="auto") as server,
        RoundTrips.installed(),
    ):
        store = kvstate.connect(server.url, namespace="bench-aborts")
        try:
            doc: dict[str, Any] = {
                "command": "python tools/bench_aborts.py" + (" --smoke" if args.smoke else ""),
                "reps": reps,
                "aborts": [aborts(store, n, reps) for n in counts],
                "predecessor": [predecessor(store, n) for n in counts],
            }
        finally:
            store.close()
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(
        f"{'rooms':>6} {'one by one ms':>14} {'trips':>6} {'abort_many ms':>14} {'trips':>6} ratio"
    )
    for r in doc["aborts"]:
        print(
            f"{r['rooms']:>6} {r['one_by_one_ms']:>14.2f} {r['one_by_one_round_trips']:>6} "
            f"{r['abort_many_ms']:>14.2f} {r['abort_many_round_trips']:>6} "
            f"{r['one_by_one_over_abort_many']:.2f}x"
        )
    for r in doc["predecessor"]:
        print(
            f"clear_predecessor of {r['rooms']} rooms: {r['ms']:.2f} ms, "
            f"{r['round_trips']} round trips"
        )


if __name__ == "__main__":
    main()
