"""Time and memory of decoding one transfer info (kvstate.codec), legit and hostile.

Each case runs in a process of its own (``--one``), so the peak memory traced there
(numpy's allocations included: tracemalloc) is the decode's alone. Hostile cases are
run-length page lists that total more pages than ``codec.MAX_PAGES``: they must be
refused as corrupt before anything the size of their pages is allocated (issue 30).

    python tools/bench_decode.py            # the table
    python tools/bench_decode.py --one contiguous 16777216
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tracemalloc

import msgpack
import numpy as np

CASES = [
    ("contiguous", 2**20),
    ("contiguous", 2**24),
    ("scattered", 2**20),
    ("scattered", 2**24),
    ("contiguous", 2**26),  # hostile: over MAX_PAGES (1 GiB, 3 s per decode before)
    ("contiguous", 2**31),  # hostile: a 30-byte info listing 2^31 pages (16 GiB before)
]


def info_bytes(kind: str, pages: int) -> bytes:
    """A packed transfer info listing ``pages`` pages: one run, or one-page runs."""
    if kind == "contiguous":
        runs, left, start = [], pages, 0
        while left:
            take = min(left, 2**31 - 1 - start)
            runs.append((start, take))
            left, start = left - take, 0
        pairs = np.array(runs, dtype="<i4")
    else:
        starts = np.arange(0, 2 * pages, 2, dtype="<i4")
        pairs = np.stack([starts, np.ones(pages, dtype="<i4")], axis=1)
    packed: bytes = msgpack.packb({"v": 1, "kv": pairs.tobytes(), "inc": ""}, use_bin_type=True)
    return packed


def one(kind: str, pages: int) -> None:
    from kvstate.codec import TransferInfo
    from kvstate.errors import CorruptStateError

    raw = info_bytes(kind, pages)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = f"{TransferInfo.decode('r', raw, 'k', 'f').kv_indices.size} pages"
    except CorruptStateError:
        out = "CorruptStateError"
    except MemoryError:
        out = "MemoryError"
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - len(raw)  # less the payload's own copy
    print(
        f"{kind:10} {pages:>11} pages {len(raw):>10} B  {out:18} {took * 1000:8.1f} ms "
        f"{max(peak, 0) / 2**20:8.1f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("KIND", "PAGES"))
    args = ap.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]))
        return
    print(f"{'runs':10} {'pages':>17} {'info':>12}  {'result':18} {'time':>11} {'peak':>12}")
    for kind, pages in CASES:
        cmd = [sys.executable, __file__, "--one", kind, str(pages)]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
