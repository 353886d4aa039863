"""The phases of a P/D request's life as vLLM's schedulers step through them, with
``n`` requests at a time, for kvstate's connector and NixlConnector on the same vLLM
utilities; each step's hook time and Redis round trips."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from tools.bench.steps.engine import SCHED_HOOKS, WORKER_HOOKS, Engine, Spec, Step

CONNECTORS = {"kvstate": "KVStateConnector", "nixl": "NixlConnector"}
#: the phases, in order: what is in flight while they run
PHASES = {
    "prefill_admit": "the prefill schedules the n requests, finishes them, makes n rooms",
    "prefill_held": "the prefill holds n rooms whose decode has not come yet",
    "decode_admit": "the decode admits n requests whose KV is to load",
    "decode_loading": "the decode waits for n loads (the prefill does not step)",
    "lifecycle": "both step until every room concluded and cleared (NIXL: where its "
    "worker side runs, with NIXL installed)",
}


class Pair:
    """A prefill and a decode engine of one connector, each with one local request
    always running, so that every step has a forward as a serving step does."""

    def __init__(
        self, connector: str, url: str, model_dir: str, seqs: int, forward_s: float = 0.0
    ) -> None:
        name = CONNECTORS[connector]
        self.connector = connector
        self.p = Engine(Spec("kv_producer", f"{connector}-p", name, url, model_dir, seqs))
        self.d = Engine(Spec("kv_consumer", f"{connector}-d", name, url, model_dir, seqs))
        self.p.forward_s = self.d.forward_s = forward_s
        self.runs = 0
        self.running: dict[Engine, str] = {}

    def keep_running(self, e: Engine) -> None:
        rid = self.running.get(e)
        if rid is None or rid in e.finished:
            self.runs += 1
            self.running[e] = f"run-{self.runs}"
            e.add(self.running[e], 100)

    def step(self, e: Engine) -> Step:
        self.keep_running(e)
        return e.step()

    def close(self) -> None:
        self.p.close()
        self.d.close()


def summary(steps: list[Step]) -> dict[str, Any]:
    """Per step: hook time (median and mean, us), round trips (most, mean), calls."""
    if not steps:
        return {"steps": 0}

    def us(names: tuple[str, ...]) -> list[float]:
        return [sum(s.spent.get(n, 0.0) for n in names) * 1e6 for s in steps]

    out: dict[str, Any] = {"steps": len(steps)}
    for part, names in (
        ("sched", SCHED_HOOKS),
        ("worker", WORKER_HOOKS),
        ("all", SCHED_HOOKS + WORKER_HOOKS),
    ):
        v = us(names)
        out[f"{part}_hooks_us_median"] = round(statistics.median(v), 1)
        out[f"{part}_hooks_us_mean"] = round(statistics.fmean(v), 1)
    out["all_hooks_ms_total"] = round(sum(us(SCHED_HOOKS + WORKER_HOOKS)) / 1000, 2)
    trips = [s.trips for s in steps]
    out["round_trips_max"] = max(trips)
    out["round_trips_mean"] = round(statistics.fmean(trips), 2)
    out["round_trips_behind"] = sum(s.behind for s in steps)  # not waited for by the step
    out["round_trips_behind_max"] = max(s.behind for s in steps)
    # what kvstate's runs behind the steps ran (its worker's work: rooms made, polls,
    # pushes, finishes, clears), on a thread of their own that shares the GIL with the
    # engine's: the work the hooks handed over, which a forward that lets go of it hides
    out["behind_ms_total"] = round(sum(s.behind_s for s in steps) * 1000, 2)
    pushes = [s for s in steps if s.moved]  # the prefill's steps that pushed pages
    if pushes:
        out["push_steps"] = len(pushes)
        out["push_hooks_us_median"] = round(
            statistics.median(sum(s.spent.values()) * 1e6 for s in pushes), 1
        )
        out["push_round_trips_max"] = max(s.trips for s in pushes)
    calls: dict[str, int] = {}
    for s in steps:
        for k, v in s.calls.items():
            calls[k] = calls.get(k, 0) + v
    out["hook_calls"] = dict(sorted(calls.items()))
    by_name: dict[str, float] = {}
    for s in steps:
        for k, v in s.spent.items():
            by_name[k] = by_name.get(k, 0.0) + v
    out["hook_us_per_step_by_name"] = {
        k: round(v * 1e6 / len(steps), 2) for k, v in sorted(by_name.items())
    }
    most: dict[str, int] = {}  # the most round trips one step made in each hook
    for s in steps:
        for k, v in s.hook_trips.items():
            most[k] = max(most.get(k, 0), v)
    out["round_trips_max_by_hook"] = dict(sorted(most.items()))
    return out


def until(
    pair: Pair, engines: list[Engine], done: Callable[[], bool], cap: int, patience: float = 60.0
) -> list[Step]:
    """Step ``engines`` in turn until ``done()``; every step made. Past ``cap`` rounds
    it goes on 1 ms apart for up to ``patience`` s: NIXL's handshakes and reads run on
    threads of its own, which a loop of fast steps outruns."""
    out: list[Step] = []
    deadline = time.monotonic() + patience
    rounds = 0
    while not done():
        if rounds >= cap:
            if time.monotonic() > deadline:
                raise AssertionError(f"{pair.connector}: not done after {rounds} rounds")
            time.sleep(0.001)
        out += [pair.step(e) for e in engines]
        rounds += 1
    return out


def run_count(pair: Pair, n: int, steps: int, tag: str) -> dict[str, Any]:
    """The phases with ``n`` requests in flight (0: only the running requests); each
    phase's wall time beside its steps' figures (``wall_ms``: steps, forwards and what
    runs behind them, until the phase's end)."""
    p, d = pair.p, pair.d
    res: dict[str, list[Step]] = {k: [] for k in PHASES}
    wall: dict[str, float] = {}
    rids = [f"{tag}-{n}-{i}" for i in range(n)]

    def phase(name: str, run: Callable[[], list[Step]]) -> None:
        t0 = time.perf_counter()
        res[name] = run()
        wall[name] = (time.perf_counter() - t0) * 1000

    for rid in rids:
        p.add(rid, 1, {"do_remote_decode": True})
    phase("prefill_admit", lambda: until(pair, [p], lambda: all(r in p.params for r in rids), 20))
    phase("prefill_held", lambda: [pair.step(p) for _ in range(steps)])
    for rid in rids:
        d.add(rid, 2, p.params[rid])
    phase("decode_admit", lambda: [pair.step(d) for _ in range(2)])
    phase("decode_loading", lambda: [pair.step(d) for _ in range(steps)])
    if p.worker is not None:
        sched = [p.scheduler, d.scheduler]
        phase(
            "lifecycle",
            lambda: until(
                pair,
                [p, d],
                lambda: (
                    all(r in d.finished for r in rids)
                    and not any(r in s.requests for s in sched for r in rids)
                ),
                400,
            ),
        )
    else:  # NIXL without its worker side: its loads never conclude; aborted
        from vllm.v1.request import RequestStatus

        for e in (p, d):
            e.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        for _ in range(3):
            pair.step(p)
            pair.step(d)
    out = {k: summary(v) for k, v in res.items()}
    for k, ms in wall.items():
        if out[k]["steps"]:
            out[k]["wall_ms"] = round(ms, 2)
    return out


def measure(
    url: str, model_dir: str, counts: list[int], steps: int, forward_s: float = 0.0
) -> dict[str, Any]:
    """Every count, kvstate's connector and NixlConnector's scheduler side, one pair of
    engines each (made once, for the largest count), counts in turn."""
    seqs = max(counts) + 8
    pairs = {c: Pair(c, url, model_dir, seqs, forward_s) for c in CONNECTORS}
    out: dict[str, Any] = {c: {} for c in CONNECTORS}
    try:
        for pair in pairs.values():  # warm: scripts loaded, connections and UCX up
            run_count(pair, 2, 2, "warm")
        # as EngineCore does once started: the startup heap (vLLM's, torch's) frozen, so
        # that an oldest-generation collection does not walk it (100-300 ms here,
        # landing in whichever hook it falls in)
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        for n in counts:
            for c, pair in pairs.items():
                out[c][str(n)] = run_count(pair, n, steps, "q")
    finally:
        for pair in pairs.values():
            pair.close()
    return out


def ratios(doc: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """kvstate over NIXL per step (median hook us) in each phase both run: the
    scheduler-side hooks alone, kvstate's scheduler + worker hooks over NIXL's
    scheduler side, and (where NIXL's worker side ran) both sides over both sides."""
    out: dict[str, Any] = {}
    for n in counts:
        row: dict[str, Any] = {}
        for phase in ("prefill_admit", "prefill_held", "decode_admit", "decode_loading"):
            k, x = doc["kvstate"][str(n)][phase], doc["nixl"][str(n)][phase]
            base = x.get("sched_hooks_us_median", 0.0)
            if not base:
                row[phase] = None
                continue
            row[phase] = {
                "sched_over_nixl_sched": round(k["sched_hooks_us_median"] / base, 2),
                "all_over_nixl_sched": round(k["all_hooks_us_median"] / base, 2),
                "nixl_sched_hooks_us": base,
            }
            if x.get("worker_hooks_us_median"):  # NIXL's worker side ran: like for like
                row[phase]["all_over_nixl_all"] = round(
                    k["all_hooks_us_median"] / x["all_hooks_us_median"], 2
                )
                row[phase]["nixl_all_hooks_us"] = x["all_hooks_us_median"]
        out[str(n)] = row
    return out


def targets(doc: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """Round trips: 0 a step with nothing in flight, at most 1 a step otherwise."""
    worst: dict[str, int] = {}
    for n in counts:
        for phase, s in doc["kvstate"][str(n)].items():
            if s.get("steps"):
                worst[f"{n}_{phase}"] = s["round_trips_max"]
    idle = [v for k, v in worst.items() if k.startswith("0_")]
    busy = {k: v for k, v in worst.items() if not k.startswith("0_")}
    return {
        "round_trips_idle_step_max": max(idle) if idle else None,
        "round_trips_idle_target_met": all(v == 0 for v in idle),
        "round_trips_max_per_step": busy,
        "round_trips_at_most_1_met": {k: v <= 1 for k, v in busy.items()},
    }
