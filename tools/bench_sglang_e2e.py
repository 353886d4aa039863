#!/usr/bin/env python3
"""SGLang end to end with kvstate (issue 33 target 4): TTFT and tokens/s of a prefill +
decode pair behind SGLang's router against a plain server on the same tiny model, at 1,
8 and 32 concurrent requests, and kvstate's own share of the PD TTFT read from the rooms'
traces.

The servers are the end-to-end tests' (``tests/integrations/sglang_servers.py``: real
``sglang.launch_server`` processes, SGLang's CPU engine on a CPU host, its own kernels on
a GPU host), so the benchmark runs exactly what those tests check byte for byte; it
imports them from the repository (run it from the repository root). Every room is traced
(``?trace_rate=1`` in the servers' Redis URL).

A room's phases (design.md, The room trace) split its life on the Redis server's clock:
``bootstrap`` (the first step -> every sender holds its receivers' infos: the decode
took the request from the router and published its pages), ``waiting for input`` (->
the prefill begins sending: its forward pass), ``transfer`` (-> the last Success: the
bytes move and both sides learn it). kvstate's own share of the TTFT is ``transfer``
(what kvstate does alone); ``bootstrap`` is printed beside it as an upper bound of the
handshake's cost (it also holds the decode scheduler's own steps before it publishes).

    python tools/bench_sglang_e2e.py [--concurrency 1 8 32] [--per-level 2]
        [--reserved-decode-tokens N] [--json]

The servers' KV pool is the tests' (4096 tokens): with SGLang's default of 512 tokens
reserved per decode request, about 7 requests fit the decode at once and the rest wait
in bootstrap; docs/benchmarks.md (End to end, SGLang) has both runs.

Needs the [sglang] extra and SGLang 0.5.23 (docs/sglang.md, Installing); a run takes a few
minutes on a CPU host, most of it the servers' start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT_WORDS = 51  # a few pages (16 tokens each), under the chunked-prefill size
MAX_NEW = 8


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ttft(url: str, text: str) -> tuple[float, int, float]:
    """(seconds to the first streamed chunk, tokens received, seconds to the last)."""
    from tests.integrations.sglang_servers import stream

    t0 = time.perf_counter()
    first = None
    tokens = 0
    for chunk in stream(url, text, MAX_NEW):
        if first is None:
            first = time.perf_counter() - t0
        tokens = len(chunk.get("output_ids") or ()) or tokens + 1
    return (first or 0.0), tokens, time.perf_counter() - t0


def level(url: str, concurrency: int, requests: int, offset: int) -> dict[str, Any]:
    """``requests`` requests, ``concurrency`` at a time: TTFT percentiles and tokens/s."""
    from tests.integrations.sglang_model import prompt

    texts = [prompt(PROMPT_WORDS, offset=offset + i) for i in range(requests)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda t: _ttft(url, t), texts))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    return {
        "requests": requests,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * _pct(ttfts, 0.99),
        "tokens_per_s": sum(r[1] for r in results) / wall,
    }


def phases(redis_url: str) -> dict[str, list[int]]:
    """Every traced room's phase lengths (ms), then the traces deleted for the next level."""
    from kvstate import connect
    from kvstate.ops.timeline import read_timeline

    out: dict[str, list[int]] = {}
    with connect(redis_url) as store:
        traces = list(store.scan(store.keys.trace_pattern))
        for key in traces:
            parsed = store.keys.parse_room_key(key)
            if parsed is None:
                continue
            for p in read_timeline(store, parsed.room).phases():
                out.setdefault(p.name, []).append(p.ms)
        if traces:
            store.client.delete(*traces)
    return out


def run(concurrency: list[int], per_level: int, reserved: int | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))  # the end-to-end tests' servers
    from kvstate.testing import RedisProcess
    from tests.integrations.sglang_servers import deploy, has_gpu

    with RedisProcess(port="auto") as redis, tempfile.TemporaryDirectory() as tmp:
        traced = f"{redis.url}?trace_rate=1"
        t0 = time.perf_counter()
        flags = [] if reserved is None else ["--num-reserved-decode-tokens", str(reserved)]
        pd = deploy(Path(tmp), traced, flags)
        started = time.perf_counter() - t0
        print(f"servers up in {started:.0f} s", file=sys.stderr)
        try:
            rows = []
            for i, c in enumerate(concurrency):
                n = max(c * per_level, 4)
                phases(traced)  # nothing of the level before counts
                plain = level(pd.plain.url, c, n, offset=1000 * i)
                disagg = level(pd.router.url, c, n, offset=1000 * i + 500)
                ph = phases(traced)
                med = {k: statistics.median(v) for k, v in ph.items()}
                ttft = disagg["ttft_p50_ms"]
                row = {
                    "concurrency": c,
                    "plain": plain,
                    "pd": disagg,
                    "rooms": len(ph.get("transfer", ())),
                    "phase_p50_ms": med,
                    "transfer_share": med.get("transfer", 0.0) / ttft if ttft else None,
                    "bootstrap_transfer_share": (
                        med.get("transfer", 0.0) + med.get("bootstrap", 0.0)
                    )
                    / ttft
                    if ttft
                    else None,
                }
                rows.append(row)
                print(_line(row), file=sys.stderr)
        finally:
            for proc in pd.procs():
                proc.stop()
    return {
        "device": "gpu" if has_gpu() else "cpu (SGLang's CPU engine)",
        "servers_start_s": started,
        "prompt_words": PROMPT_WORDS,
        "max_new_tokens": MAX_NEW,
        "reserved_decode_tokens": reserved,
        "levels": rows,
        "target": "transfer_share <= 0.05 at every concurrency",
    }


def _line(row: dict[str, Any]) -> str:
    pd, plain, ph = row["pd"], row["plain"], row["phase_p50_ms"]
    return (
        f"c={row['concurrency']:>2}  TTFT p50/p99 ms: plain {plain['ttft_p50_ms']:.0f}/"
        f"{plain['ttft_p99_ms']:.0f}, PD {pd['ttft_p50_ms']:.0f}/{pd['ttft_p99_ms']:.0f}  "
        f"tok/s plain {plain['tokens_per_s']:.1f}, PD {pd['tokens_per_s']:.1f}  "
        f"phases p50 ms: bootstrap {ph.get('bootstrap', 0):.0f}, waiting "
        f"{ph.get('waiting for input', 0):.0f}, transfer {ph.get('transfer', 0):.0f}  "
        f"kvstate share: transfer {100 * (row['transfer_share'] or 0):.1f}% "
        f"(+bootstrap {100 * (row['bootstrap_transfer_share'] or 0):.1f}%)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--per-level", type=int, default=2, help="requests per level: this x c")
    ap.add_argument(
        "--reserved-decode-tokens",
        type=int,
        help="the decode's --num-reserved-decode-tokens (SGLang's default 512 admits ~7 "
        "requests at once into the tests' 4096-token KV pool: the rest wait in bootstrap)",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    result = run(args.concurrency, args.per_level, args.reserved_decode_tokens)
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
