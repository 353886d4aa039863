#!/usr/bin/env python3
"""What one ``kvstate`` call costs before it does anything: start-up of the CLI.

    python tools/bench_cli.py [--runs 15]

Starts a private redis-server, then times, each as a fresh process, ``runs`` times
(median, min and max printed): ``python -c "import kvstate.cli"``, ``kvstate --help``,
and ``kvstate ls`` of an empty namespace against that server, with ``python -c pass``
as the interpreter's own floor, measured in turn with the rest. Also prints the
modules ``import kvstate.cli`` loads that a listing of rooms does not need (numpy,
the transports, the roles, prometheus_client), and ``-X importtime``'s total.
Figures depend on the host and its load: compare runs made on the same host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstate.store.redis_server import RedisServer  # noqa: E402

HEAVY = ("numpy", "transports", "kvstate.roles", "prometheus_client", "msgpack", "pynvml")


def _time(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds one run of ``cmd`` takes; exit 1 is an answer (``ls`` of an empty
    namespace), anything above it an error."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode > 1:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.decode()[-500:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    py = sys.executable
    kv = [py, "-m", "kvstate.cli"]
    with RedisServer() as server:
        env = dict(os.environ, KVSTATE_REDIS_URL=server.url, KVSTATE_NAMESPACE="bench")
        env.pop("KVSTATE_REDIS_PASSWORD", None)
        cases = {
            "python -c pass": [py, "-c", "pass"],
            "import kvstate.cli": [py, "-c", "import kvstate.cli"],
            "kvstate --help": [*kv, "--help"],
            "kvstate ls (empty namespace)": [*kv, "ls"],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):  # in turn, so that load on the host hits each alike
            for name, cmd in cases.items():
                times[name].append(_time(cmd, env))
    print(f"{'case':32} {'median':>8} {'min':>8} {'max':>8}   ({args.runs} runs, seconds)")
    for name, ts in times.items():
        print(f"{name:32} {statistics.median(ts):8.3f} {min(ts):8.3f} {max(ts):8.3f}")
    probe = (
        "import sys, kvstate.cli; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules) or 'none')"
    )
    loaded = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True)
    print(f"loaded by import kvstate.cli, of {', '.join(HEAVY)}: {loaded.stdout.strip()}")
    imp = subprocess.run(
        [py, "-X", "importtime", "-c", "import kvstate.cli"], capture_output=True, text=True
    )
    last = [line for line in imp.stderr.splitlines() if line.rstrip().endswith("kvstate.cli")]
    if last:
        total_us = int(last[-1].split("|")[1])
        print(f"-X importtime, kvstate.cli cumulative: {total_us / 1e6:.3f} s")


if __name__ == "__main__":
    main()
