"""What a run measured and how it is reported: the keys it left, the audit, the
commands Redis ran, the transfer counters, the summary document (``--json``) and the
table printed from it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstate.demo.messages import WorkerConfig
from kvstate.demo.outcome import ABORT_KINDS, OUTCOMES
from kvstate.demo.router import Options, Router
from kvstate.ops import reads
from kvstate.ops.metrics import read_transfer_totals
from kvstate.stats import drop_call
from kvstate.store import Store, redact

__all__ = [
    "console",
    "print_summary",
    "run_audit",
    "summary",
    "take_transfer_counters",
    "traces_kept",
    "wait_for_no_keys",
]

_PATHS = {"CMA": "CMA (process_vm_writev, same host)", "UCX": "UCX puts"}
_CMA_OFF = ("0", "n", "no", "false", "off")


def run_keys(store: Store, rtr: Router) -> Callable[[str], bool]:
    """Whether a key is this run's: a room it dispatched, or one of its engines'
    registrations, stats and address indexes. A namespace shared with other runs or
    engines (`--namespace`, `$KVSTATE_NAMESPACE`) holds keys that are not, and the
    verdict must not count them (issue 31)."""
    k = store.keys
    rooms = set(rtr.tracks)
    engines = set(rtr.prefills + rtr.decodes)
    addrs = set(rtr.addrs.values())
    named = {k.engine(e) for e in engines} | {k.transfer_stats(e) for e in engines}
    named |= {t for a in addrs for t in k.trackers(a)} | {k.engines_at(a) for a in addrs}

    def mine(key: str) -> bool:
        parsed = k.parse_room_key(key)
        return parsed.room in rooms if parsed is not None else key in named

    return mine


def _keys_left(store: Store, mine: Callable[[str], bool]) -> tuple[list[str], int]:
    """The run's keys still there except those kept on purpose: the ledger (a record of
    leaks), the failed rooms' marks (kept past clear() with their own TTL, for a side
    that joins late) and the room traces that have their TTL (kvstate.trace: they
    outlive ``clear()`` by design; one without a TTL would be a leak, and is counted);
    and how many keys of the namespace are not the run's (not counted)."""
    k = store.keys
    every = [key for key in store.scan(k.all_pattern) if key != k.ledger and not k.is_mark(key)]
    found = [key for key in every if mine(key)]
    traces = [key for key in found if k.is_trace(key)]
    ttls = store.execute([reads.ttl_of(key) for key in traces]) if traces else []
    kept = {key for key, ttl in zip(traces, ttls, strict=True) if int(ttl) > 0}
    return sorted(key for key in found if key not in kept), len(every) - len(found)


def traces_kept(store: Store, mine: Callable[[str], bool]) -> int:
    """How many room traces the run left for ``kvstate trace ROOM`` (each with its TTL)."""
    k = store.keys
    return sum(1 for key in store.scan(k.all_pattern) if k.is_trace(key) and mine(key))


def wait_for_no_keys(
    store: Store, limit: float, mine: Callable[[str], bool]
) -> tuple[list[str], float, int]:
    """The run's keys still there once none are, or after ``limit`` s; the seconds
    waited; and the namespace's keys that are not the run's."""
    t0 = time.monotonic()
    left, others = _keys_left(store, mine)
    while left and time.monotonic() - t0 < limit:
        time.sleep(0.25)
        left, others = _keys_left(store, mine)
    return left, time.monotonic() - t0, others


def run_audit(store: Store, mine: Callable[[str], bool]) -> dict[str, Any]:
    """The audit of the namespace, its findings on the run's keys (and the server's
    settings) only."""
    try:
        from kvstate.ops.audit import Auditor
    except ImportError:
        return {"result": "n/a"}
    report = Auditor(store, grace=0.0).run()
    report.findings = [f for f in report.findings if f.room is None and not f.side or mine(f.key)]
    doc: dict[str, Any] = report.to_json()
    kinds = sorted({f["kind"] for f in doc["findings"]})
    doc["result"] = (
        "clean" if doc["clean"] else f"{len(doc['findings'])} finding(s): " + ", ".join(kinds)
    )
    return doc


def take_transfer_counters(store: Store, rtr: Router) -> dict[str, dict[str, Any]]:
    """The transfer counters the workers published for the monitor, as the monitor
    would export them; then deleted, so the demo leaves no key behind."""
    totals = {
        e: t
        for e, t in read_transfer_totals(store).items()
        if e in rtr.prefills or e in rtr.decodes
    }
    if totals:
        store.execute([drop_call(store, e) for e in totals])
    return {
        e: {"bytes": t.bytes, "transfers": t.count, "seconds": round(t.seconds, 4)}
        for e, t in totals.items()
    }


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _write_path(rtr: Router) -> str:
    """Which data path moved the bytes: kvstate's transport writes same-host host memory
    with process_vm_writev (CMA) and everything else with UCX puts."""
    hosts = {rtr.hosts.get(e) for e in rtr.prefills + rtr.decodes}
    refused = any(s.get("cma_refused") for s in rtr.stats.values())
    cma_on = os.environ.get("KVSTATE_UCX_CMA", "1").strip().lower() not in _CMA_OFF
    if rtr.cfg.device == "cpu" and len(hosts) == 1 and cma_on and not refused:
        return "CMA"
    return "UCX"


class _Rooms:
    """Every room's outcome, and the bytes and times of the rooms that were done."""

    def __init__(self, rtr: Router) -> None:
        self.rooms: list[dict[str, Any]] = []
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.latencies: list[float] = []
        self.nbytes = 0
        self.send_s = self.write_s = self.verify_s = 0.0
        for track in rtr.tracks.values():
            kind = track.outcome(rtr.killed)
            self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
            rx, tx = track.results.get("decode"), track.results.get("prefill")
            if kind == "done" and rx is not None:
                self.latencies.append((track.done_at - track.sent_at) * 1000)
                self.nbytes += rx.nbytes
                self.verify_s += rx.busy_s
                self.send_s += tx.busy_s if tx is not None else 0.0
                self.write_s += tx.write_s if tx is not None else 0.0
            self.rooms.append(
                {
                    "room": track.job.room,
                    "outcome": kind,
                    "pages": track.job.pages,
                    "prefill": track.job.prefill,
                    "decode": track.decode,
                    "abort": track.abort,
                    "verified": rx.verified if rx is not None else None,
                    "bad_pages": rx.bad_pages if rx is not None else 0,
                    "decode_status": rx.status if rx is not None else None,
                    "decode_reason": rx.reason if rx is not None else "",
                    "prefill_status": tx.status
                    if tx is not None
                    else ("killed" if track.prefill_dead else None),
                    "prefill_reason": tx.reason if tx is not None else "",
                }
            )


def _redis_figures(
    cfg: WorkerConfig, rtr: Router, before: dict[str, int], after: dict[str, int]
) -> dict[str, Any]:
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k != "info"}
    by_command = dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -kv[1]))
    calls = sum(by_command.values())
    dispatched = max(1, len(rtr.tracks))
    trips = sum(int(s.get("round_trips", 0)) for s in rtr.stats.values())
    return {
        "url": redact(cfg.url),
        "namespace": cfg.namespace,
        # calls to Store.execute by the workers (one round trip each on a standalone
        # server): both sides, polls while waiting and heartbeats included
        "round_trips": trips,
        "round_trips_per_room": None if cfg.hold else round(trips / dispatched, 1),
        # commands Redis executed (INFO commandstats), those inside scripts included
        "commands": calls,
        "commands_per_room": None if cfg.hold else round(calls / dispatched, 1),
        "by_command": by_command,
    }


def summary(
    opts: Options,
    cfg: WorkerConfig,
    rtr: Router,
    seconds: float,
    before: dict[str, int],
    after: dict[str, int],
    left: list[str] | None,
    waited: float,
    audit: dict[str, Any],
    counters: dict[str, dict[str, Any]],
    cut: str | None = None,
    traces: int | None = None,
    others: int = 0,
) -> dict[str, Any]:
    """The run as one JSON document: what ``--json`` prints and the table is made of.
    ``left`` is None when a signal (``cut``, or the one that interrupted the run) stopped
    the checks before the keys were read. With ``--hold`` the figures that would time the
    hold (throughput, room latency, calls per room: each room waited on purpose) are
    None, not numbers that measure kvstate."""
    r = _Rooms(rtr)
    outcomes, nbytes, send_s, write_s = r.outcomes, r.nbytes, r.send_s, r.write_s
    injected = [t.abort for t in rtr.tracks.values() if t.abort]
    aborts = {
        "injected": len(injected),
        "landed": outcomes["aborted"],
        "by": {k: injected.count(k) for k in ABORT_KINDS},
    }
    unexpected = outcomes["failed"] + outcomes["corrupt"]
    verified = all(x["verified"] for x in r.rooms if x["decode_status"] == "Success")
    ok = verified and left == [] and unexpected == 0 and not rtr.interrupted and not cut
    held = cfg.hold > 0
    return {
        "ok": ok,
        "interrupted": signal.Signals(rtr.interrupted).name if rtr.interrupted else None,
        "checks_cut_short_by": cut,
        "requests": opts.requests,
        "dispatched": len(rtr.tracks),
        "outcomes": outcomes,
        "aborts": aborts,
        "all_success_verified": verified,
        "bytes_verified": nbytes,
        "seconds": round(seconds, 3),
        # verified bytes over the run's wall time (waiting, pattern filling and
        # verifying included): what the whole pipeline sustained
        "gb_per_s": None if held else round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
        # the same bytes over the time prefill workers spent inside send(): the write
        # plus the two state transitions (begin, finish) in Redis
        "send_gb_per_s": round(nbytes / send_s / 1e9, 3) if send_s else 0.0,
        # the same bytes over the time inside the transport's write alone (the data
        # plane), by the path named in write_path
        "write_gb_per_s": round(nbytes / write_s / 1e9, 3) if write_s else 0.0,
        "write_path": _write_path(rtr),
        # share of the time inside send() that was not the write: the state's cost
        "state_share_of_send": round(1 - write_s / send_s, 3) if send_s and write_s else 0.0,
        "verify_s": round(r.verify_s, 3),
        "latency_ms": None
        if held
        else {
            "p50": round(_percentile(r.latencies, 50), 2),
            "p99": round(_percentile(r.latencies, 99), 2),
            "max": round(max(r.latencies, default=0.0), 2),
        },
        "redis": _redis_figures(cfg, rtr, before, after),
        "transfer_counters": counters,
        "keys_left": None if left is None else len(left),
        "keys_left_sample": (left or [])[:10],
        # keys of the namespace that are not this run's (a shared namespace): not counted
        "other_keys": others,
        # room traces kept on purpose, each with its TTL (not counted in keys_left)
        "traces_kept": traces,
        "waited_for_keys_s": round(waited, 2),
        "audit": audit,
        "killed": rtr.killed,
        "workers": {
            "prefill": opts.prefill_workers,
            "decode": opts.decode_workers,
            "transport": rtr.stats,
        },
        "config": {
            "page_bytes": cfg.page_bytes,
            "pool_pages": cfg.pool_pages,
            "layers": cfg.layers,
            "pages_per_request": [opts.pages_min, opts.pages_max],
            "device": cfg.device,
            "lease_s": cfg.lease,
            "room_ttl_s": cfg.room_ttl,
            "hold_s": cfg.hold,
            "abort_rate": opts.abort_rate,
            "kill_prefill_after": opts.kill_prefill_after,
            "seed": opts.seed,
        },
        "rooms": r.rooms,
    }


def _print_stripped(out: Any, table: Any) -> None:
    """Print ``table``; not to a terminal, each line without rich's cell padding (as the
    CLI's console does: the demo sits below the CLI and does not import it)."""
    if out.is_terminal:
        out.print(table)
        return
    with out.capture() as captured:
        out.print(table)
    out.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(stderr=stderr, width=width, highlight=False)


def print_summary(doc: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    o = doc["outcomes"]
    t = Table(title="kvstate demo", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row(
        "rooms",
        f"{doc['requests']} requested, {doc['dispatched']} dispatched: "
        f"done {o['done']}, failed {o['failed']}, aborted {o['aborted']}, "
        f"killed-peer {o['killed']}, corrupt {o['corrupt']}"
        + (f", interrupted {o['interrupted']}" if o["interrupted"] else ""),
    )
    a = doc["aborts"]
    if a["injected"]:
        by = ", ".join(f"{k} {v}" for k, v in a["by"].items())
        t.add_row(
            "aborts",
            f"{a['injected']} injected ({by}); {a['landed']} landed, the rest finished first",
        )
    t.add_row(
        "bytes verified",
        f"{doc['bytes_verified'] / 1e6:.1f} MB "
        f"({'all successful rooms match' if doc['all_success_verified'] else 'MISMATCH'})",
    )
    hold = doc["config"]["hold_s"]
    if doc["gb_per_s"] is not None:
        t.add_row(
            "end to end",
            f"{doc['gb_per_s']:.3f} GB/s: verified bytes / {doc['seconds']:.2f} s "
            "of wall time (waiting, filling and verifying pages included)",
        )
    path = _PATHS.get(doc["write_path"], doc["write_path"])
    t.add_row(
        "data plane",
        f"{doc['write_gb_per_s']:.2f} GB/s: the same bytes / time inside "
        f"the transport's write alone, via {path}",
    )
    t.add_row(
        "send() call",
        f"{doc['send_gb_per_s']:.2f} GB/s: the same bytes / time inside "
        f"send() = that write + 2 Redis state transitions; "
        f"{doc['state_share_of_send']:.0%} of it outside the write",
    )
    lat, r = doc["latency_ms"], doc["redis"]
    if lat is None:
        t.add_row(
            "timing",
            f"not measured: each room waited {hold:g} s on purpose (--hold), so "
            "throughput, latency and Redis calls per room would time the wait; run "
            "without --hold for them",
        )
    else:
        t.add_row(
            "room latency",
            f"p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms "
            "(router dispatch to both sides' results)",
        )
        t.add_row(
            "redis per room",
            f"{r['round_trips_per_room']} round trips from the workers "
            "(both sides; polls while waiting and heartbeats included, a poll_many shared "
            f"by the rooms it covers; one room alone: 7); {r['commands_per_room']} commands "
            "Redis executed (script internals included)",
        )
    if doc["keys_left"] is None:
        t.add_row("keys left", "not checked: a signal stopped the wait for them")
    else:
        t.add_row(
            "keys left",
            f"{doc['keys_left']}"
            + (
                f" after {doc['waited_for_keys_s']:.1f} s"
                if doc["waited_for_keys_s"] >= 0.5
                else ""
            ),
        )
    if doc.get("other_keys"):
        t.add_row(
            "other keys",
            f"{doc['other_keys']} in namespace {doc['redis']['namespace']} are not this run's "
            "(another run or engine shares it): not counted",
        )
    if doc.get("traces_kept"):
        example = doc["rooms"][0]["room"] if doc["rooms"] else "ROOM"
        t.add_row(
            "room traces",
            f"{doc['traces_kept']} kept for their TTL: kvstate --url {doc['redis']['url']} -n "
            f"{doc['redis']['namespace']} trace {example} shows where that room's time went (an "
            "embedded Redis stops with the demo: give --url, or --hold, to look after it)",
        )
    t.add_row("audit", escape(doc["audit"]["result"]))
    if doc["killed"]:
        lost = [r for r in doc["rooms"] if r["outcome"] == "killed"]
        why = f"; e.g. {escape(lost[0]['decode_reason'])}" if lost else ""
        t.add_row("killed", f"{doc['killed']} (SIGKILL), {len(lost)} room(s) in flight{why}")
    if doc["interrupted"]:
        t.add_row(
            "result",
            f"[yellow]INTERRUPTED[/yellow] by {doc['interrupted']}: partial "
            f"run, {o['interrupted']} room(s) in flight cleared",
        )
    elif doc["checks_cut_short_by"]:
        t.add_row(
            "result",
            f"[yellow]CHECKS CUT SHORT[/yellow] by {doc['checks_cut_short_by']}: every "
            "room ran; the checks after it did not finish",
        )
    else:
        t.add_row("result", "[green]OK[/green]" if doc["ok"] else "[red]FAILED[/red]")
    out = console()
    _print_stripped(out, t)
    for room in doc["rooms"]:
        if room["outcome"] in ("failed", "corrupt"):
            out.print(
                f"  room {room['room']}: {room['outcome']}: "
                f"{escape(room['decode_reason'] or room['prefill_reason'])}"
            )
    for key in doc["keys_left_sample"]:
        out.print(f"  key left: {escape(key)}")
