"""One mode's run: every system's pair started, timed rep by rep in turn, verified."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.transfer.lanes import logged
from tools.bench.transfer.pair import Pair
from tools.bench.transfer.runs import copy_ops
from tools.bench.transfer.sites import site as site_of
from tools.bench.transfer.systems import INSTALL, System, available, systems
from tools.bench.transfer.workload import Config, sender_layer


def memcpy_baseline(cfg: Config, layouts: dict[str, Any]) -> dict[str, Any]:
    """In-process copies of the same runs, in this process after every pair is done: the
    old ceiling, kept beside the memcpy row timed in turn (it was 1.6-2.3x faster here,
    never following another system's transfer)."""
    src_bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]
    ops = copy_ops(cfg, layouts, src_bufs, [np.ones_like(b) for b in src_bufs])
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(cfg.warmup + cfg.reps):
        for name, op in ops.items():
            t0 = time.perf_counter()
            op()
            if rep >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: {"times": t, "verified": None} for name, t in times.items()}


def row(mode: str, system: System, case: str, nbytes: int, r: dict[str, Any]) -> dict[str, Any]:
    t = r["times"]
    return {
        "mode": mode,
        "system": system.key,
        "label": system.label,
        "path": system.path,
        "family": system.family,
        "settings": system.settings(),
        "case": case,
        "gbps": round(nbytes / statistics.median(t) / 1e9, 3),
        "gbps_min": round(nbytes / max(t) / 1e9, 3),
        "gbps_max": round(nbytes / min(t) / 1e9, 3),
        "median_ms": round(statistics.median(t) * 1e3, 4),  # a tiny in-process copy is us
        "reps": len(t),
        "verified": r.get("verified"),
        "rss_mib": r.get("rss_mib"),
    }


def run_mode(
    mode: str,
    cfg: Config,
    layouts: dict[str, Any],
    skip: set[str],
    lanes: list[int],
    extras: tuple[tuple[str, dict[str, str]], ...],
    say: Callable[[str], None],
    notes: list[str],
    lanes_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Start every system's pair, then time them rep by rep in turn (so a burst of load
    from elsewhere hits all of them alike), then verify each. ``lanes_dir``: UCX users
    log their endpoints' transports there (``lanes``)."""
    rows: list[dict[str, Any]] = []
    with site_of(mode) as site, contextlib.ExitStack() as stack:
        say(f"[{mode}] {site.note}")
        notes.append(f"{mode}: {site.note}")
        pairs: list[Pair] = []
        for system in systems(mode, lanes, extras):
            if system.key in skip or system.kind in skip or system.family in skip:
                notes.append(f"{mode}: {system.label}: skipped (--skip)")
                continue
            if system.module and not available(system.module):
                notes.append(
                    f"{mode}: {system.label}: not installed ({INSTALL[system.module]}; "
                    "docs/development.md)"
                )
                continue
            say(f"[{mode}] starting {system.label} ...")
            if lanes_dir is not None:
                system = logged(system, lanes_dir, mode)
            try:
                pairs.append(Pair(system, cfg, site, layouts))
            except Exception as exc:
                notes.append(f"{mode}: {system.label}: failed: {str(exc).splitlines()[0]}")
                continue
            stack.callback(pairs[-1].close)
            pairs[-1].pause(True)
        times: dict[str, dict[str, list[float]]] = {p.system.key: {} for p in pairs}
        say(f"[{mode}] {cfg.warmup} warm-up and {cfg.reps} timed reps, systems in turn ...")
        order = random.Random(7)
        for rep in range(cfg.warmup + cfg.reps):
            # A fresh order every rep: what ran just before a system slows it (a socket
            # transfer cut the next in-process memcpy by up to 40% here), so no system
            # may always follow the same one.
            turn = list(pairs)
            order.shuffle(turn)
            for pair in turn:
                try:
                    pair.pause(False)
                    got = pair.call("rep")
                    pair.pause(True)
                except Exception as exc:
                    notes.append(f"{mode}: {pair.system.label}: failed: {str(exc).splitlines()[0]}")
                    pairs.remove(pair)
                    continue
                if rep >= cfg.warmup:
                    for case, t in got.items():
                        times[pair.system.key].setdefault(case, []).append(t)
        for pair in pairs:
            try:
                pair.pause(False)
                checks = pair.call("verify")
                pair.pause(True)
            except Exception as exc:
                notes.append(f"{mode}: {pair.system.label}: failed: {str(exc).splitlines()[0]}")
                continue
            for case, check in checks.items():
                r = {"times": times[pair.system.key][case]} | check
                rows.append(row(mode, pair.system, case, cfg.total_bytes, r))
                if not check["verified"]:
                    notes.append(f"{mode}: {pair.system.label}/{case}: receiver bytes differ")
    if mode == "same-host" and "memcpy" not in skip:
        alone = System(
            "memcpy-alone",
            "numpy memcpy in the main process, after the run (not in turn)",
            "memcpy",
            family="memcpy-alone",
        )
        rows += [
            row(mode, alone, case, cfg.total_bytes, r)
            for case, r in memcpy_baseline(cfg, layouts).items()
        ]
    return rows
