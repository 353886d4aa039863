"""Redis-side counters: what a block of the workload cost the servers.

INFO commandstats and INFO cpu deltas per primary, and SLOWLOG's per-call times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

from kvstate.store.functions import FUNCTIONS
from kvstate.store.scripts import SHAS
from kvstate.testing import RedisCluster, RedisProcess

SCRIPT_OF = {sha: name for name, sha in SHAS.items()} | {f: n for n, f in FUNCTIONS.items()}
# Redis command time: a script's or EXEC's includes the commands it runs
TOP = ("fcall", "evalsha", "eval", "exec")


def primaries(server: RedisProcess | RedisCluster) -> list[redis.Redis]:
    if isinstance(server, RedisCluster):
        return [n.client() for n in server.nodes]
    return [server.client()]


class RedisCost:
    """INFO commandstats (usec) and INFO cpu deltas over a block, per primary."""

    def __init__(self, nodes: list[redis.Redis]) -> None:
        self.nodes = nodes
        self.cmd_us: list[float] = [0.0] * len(nodes)
        self.cpu_us: list[float] = [0.0] * len(nodes)
        self.calls: list[float] = [0.0] * len(nodes)
        self.scripts: list[float] = [0.0] * len(nodes)

    @staticmethod
    def _read(c: redis.Redis) -> tuple[float, float, float, float]:
        """(us in top-level calls, Redis CPU us, commands run, script calls); a script's
        or EXEC's time includes the commands it runs, so only FCALL, EVALSHA, EVAL and
        EXEC are summed for the time (kvstate's few plain top-level reads are left out)."""
        stats = c.info("commandstats")
        top = calls = scripts = 0.0
        for k, v in stats.items():
            name = k.split("_", 1)[1].split("|")[0]
            if name in ("info", "config", "slowlog", "ping", "script"):
                continue
            calls += float(v["calls"])
            if name in TOP:
                top += float(v["usec"])
                scripts += float(v["calls"]) if name != "exec" else 0.0
        cpu = c.info("cpu")
        cpu_us = (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])) * 1e6
        return top, cpu_us, calls, scripts

    @contextmanager
    def measuring(self) -> Iterator[RedisCost]:
        before = [self._read(c) for c in self.nodes]
        yield self
        after = [self._read(c) for c in self.nodes]
        self.cmd_us = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        self.cpu_us = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        self.calls = [a[2] - b[2] for a, b in zip(after, before, strict=True)]
        self.scripts = [a[3] - b[3] for a, b in zip(after, before, strict=True)]

    def add(self, block: RedisCost) -> None:
        """Add ``block``'s deltas to these (a sum over many blocks)."""
        self.cmd_us = [a + b for a, b in zip(self.cmd_us, block.cmd_us, strict=True)]
        self.cpu_us = [a + b for a, b in zip(self.cpu_us, block.cpu_us, strict=True)]
        self.calls = [a + b for a, b in zip(self.calls, block.calls, strict=True)]
        self.scripts = [a + b for a, b in zip(self.scripts, block.scripts, strict=True)]


def redis_us(nodes: list[redis.Redis]) -> tuple[float, float]:
    """(us in top-level calls, WAIT's included; Redis CPU us), summed over ``nodes``."""
    cmd = cpu = 0.0
    for c in nodes:
        for k, v in c.info("commandstats").items():
            if k.split("_", 1)[1].split("|")[0] in (*TOP, "wait"):
                cmd += float(v["usec"])
        info = c.info("cpu")
        cpu += (float(info["used_cpu_sys"]) + float(info["used_cpu_user"])) * 1e6
    return cmd, cpu


def script_costs(nodes: list[redis.Redis], run: Callable[[], None]) -> dict[str, float]:
    """Median us per call of each script (and MULTI/EXEC...) while ``run()`` runs, from
    SLOWLOG at threshold 0 (its own pass: the slowlog costs Redis time itself)."""
    saved: list[Any] = [c.config_get("slowlog-*") for c in nodes]
    for c in nodes:
        c.config_set("slowlog-log-slower-than", 0)
        c.config_set("slowlog-max-len", 100_000)
        c.slowlog_reset()
    try:
        run()
        entries = [e for c in nodes for e in c.execute_command("SLOWLOG", "GET", -1)]  # type: ignore[no-untyped-call]
    finally:
        for c, conf in zip(nodes, saved, strict=True):
            for k, v in conf.items():
                c.config_set(k, v)
    per: dict[str, list[int]] = {}
    for entry in entries:
        args = [a.decode("latin-1") if isinstance(a, bytes) else str(a) for a in entry[3]]
        name = args[0].lower()
        if name in ("fcall", "evalsha", "eval") and len(args) > 1:
            name = "eval" if name == "eval" else SCRIPT_OF.get(args[1], args[1][:8])
        if name in ("slowlog", "config", "info", "ping", "client", "hello"):
            continue
        per.setdefault(name, []).append(int(entry[2]))
    # the median: on a shared machine a few calls descheduled mid-way skew a mean
    return {k: float(np.median(v)) for k, v in sorted(per.items())}
