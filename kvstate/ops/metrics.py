"""Prometheus view of the state: gauges computed from Redis by the monitor, so they
survive engine crashes, plus transfer counters that engines publish to Redis.

Why transfer counters go through Redis: the monitor is its own process, and a
prometheus_client counter only counts what happens in the process that holds it,
so ``kvstate_transfer_bytes_total`` stayed 0 while engines moved gigabytes. Each
engine now keeps its totals in memory (:class:`TransferRecorder`) and writes them,
as absolute values, to ``kvstate:<ns>:stats:<engine>`` at most once per
``flush_interval`` (one HSET + PEXPIRE: no extra round trip per transfer, and a
retried write cannot double count). The monitor reads every engine's hash each
sweep and exports them labelled by engine; an engine that restarts starts again
from 0, which Prometheus reads as a counter reset.

Each ``Metrics`` has its own registry (never prometheus_client's global one), so
several can live in one process and tests scrape exactly what they set. No URL
or other secret is ever a label.
"""

from __future__ import annotations

import errno
import logging
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from kvstate.errors import MetricsPortError
from kvstate.keys import SIDES
from kvstate.ops import reads
from kvstate.ops.findings import NAMES as FINDING_KINDS
from kvstate.ops.views import AGE_BUCKETS, STATUSES, Census
from kvstate.stats import LATENCY_BUCKETS, TransferTotals
from kvstate.store import Store

log = logging.getLogger(__name__)

PHASES = ("bootstrap", "waiting_for_input", "transfer", "until_clear")
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LOCAL_ENGINE = "this-process"  # the label of transfers observed in the exporting process
_REAPED_MEMORY = 100_000  # rooms remembered so a room is counted once, not per participant


def build_info() -> dict[str, str]:
    """What ``kvstate_build_info`` labels: kvstate's release, Python's, redis-py's."""
    out = {"python": platform.python_version()}
    for label, dist in (("version", "kvstate"), ("redis_py", "redis")):
        try:
            out[label] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[label] = "unknown"
    return out


def read_transfer_totals(store: Store) -> dict[str, TransferTotals]:
    """Every engine's published transfer counters in the namespace (SCAN + HGETALLs)."""
    prefix = store.keys.transfer_stats("")
    keys = sorted(store.scan(store.keys.transfer_stats_pattern))
    if not keys:
        return {}
    raw = store.execute([reads.hash_of(k) for k in keys], partial=True)
    return {  # a key of the wrong type exports nothing (the audit names it)
        k[len(prefix) :]: TransferTotals.parse(h)
        for k, h in zip(keys, raw, strict=True)
        if h and not isinstance(h, Exception)
    }


class _TransferCollector:
    """Exports per-engine transfer totals as a counter and a histogram at scrape time."""

    def __init__(self) -> None:
        self.totals: dict[str, TransferTotals] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            totals = {e: t for e, t in self.totals.items()}
        nbytes = CounterMetricFamily(
            "kvstate_transfer_bytes",
            "KV bytes moved, by engine (published by each engine)",
            labels=["engine"],
        )
        hist = HistogramMetricFamily(
            "kvstate_transfer_seconds",
            "Latency of one room's transfer (the write alone), by engine",
            labels=["engine"],
        )
        for engine in sorted(totals):
            t = totals[engine]
            nbytes.add_metric([engine], t.bytes)
            cumulative, running = [], 0
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], t.buckets, strict=True):
                running += n
                cumulative.append((bound, float(running)))
            hist.add_metric([engine], cumulative, t.seconds)
        yield nbytes
        yield hist

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())


class Metrics:
    """All kvstate metrics in one private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.participants = Gauge(
            "kvstate_participants",
            "Participants stored, by side and status",
            ["side", "status"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvstate_inflight_participants",
            "Non-terminal participants by age since creation (server clock)",
            ["age"],
            registry=r,
        )
        self.reaped = Counter(
            "kvstate_rooms_reaped",
            "Rooms with a participant reaped by TTL (never cleared), by the first such "
            "participant's last status; each room counted once",
            ["status"],
            registry=r,
        )
        self.participants_reaped = Counter(
            "kvstate_participants_reaped",
            "Participants reaped by TTL (never cleared), by side and last status",
            ["side", "status"],
            registry=r,
        )
        self.findings = Gauge(
            "kvstate_audit_findings", "Findings of the latest audit, by kind", ["kind"], registry=r
        )
        self.engines = Gauge(
            "kvstate_engines_alive", "Engines holding a lease, by role", ["role"], registry=r
        )
        self._transfers = _TransferCollector()
        self._local = TransferTotals()
        r.register(self._transfers)
        self.sweeps = Counter("kvstate_monitor_sweeps", "Monitor sweeps done", registry=r)
        self.up = Gauge(
            "kvstate_up",
            "1 when the monitor's last sweep of Redis succeeded, 0 when it failed (the "
            "gauges read from Redis are then absent, not stale)",
            registry=r,
        )
        self.last_good = Gauge(
            "kvstate_last_good_sweep_timestamp_seconds",
            "Unix time of the monitor's last sweep that succeeded",
            registry=r,
        )
        self.phases = Histogram(
            "kvstate_room_phase_seconds",
            "How long traced rooms spent in each phase (bootstrap, waiting_for_input, "
            "transfer, until_clear), by the room's outcome; each room once it ended",
            ["phase", "outcome"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        for phase in PHASES:
            for outcome in ("success", "failed"):
                self.phases.labels(phase, outcome)
        self.build = Info("kvstate_build", "The monitor's kvstate release", registry=r)
        self.build.info(build_info())
        self.sweep_failures = Counter(
            "kvstate_monitor_sweep_failures",
            "Monitor sweeps that failed (Redis unreachable, stalled or refusing)",
            registry=r,
        )
        # The standard process_* and python_* metrics, as the default registry has them.
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(standard)
        self._reaped_rooms: OrderedDict[int, None] = OrderedDict()
        # every label the counters count under, at 0 from the start: a dashboard panel
        # of a healthy system shows 0, not "No data", and increase() sees the first reap
        for status in (*STATUSES, "unknown"):
            self.reaped.labels(status)
            for side in SIDES:
                self.participants_reaped.labels(side, status)

    def sweep_succeeded(self) -> None:
        """A sweep read Redis and set the gauges: the monitor is up."""
        self.sweeps.inc()
        self.up.set(1)
        self.last_good.set(time.time())

    def sweep_failed(self) -> None:
        """A sweep failed: ``kvstate_up`` 0, and the gauges read from Redis go (a scrape
        must not show the last counts as if they were current); they come back with the
        next good sweep, the audit's with the next audit."""
        self.up.set(0)
        self.sweep_failures.inc()
        for gauge in (self.participants, self.inflight, self.engines, self.findings):
            gauge.clear()

    def observe_room(self, phases: Iterable[tuple[str, float]], failed: bool) -> None:
        """One ended room's phases (label, seconds) into ``kvstate_room_phase_seconds``."""
        outcome = "failed" if failed else "success"
        for phase, seconds in phases:
            self.phases.labels(phase, outcome).observe(seconds)

    def set_census(self, census: Census) -> None:
        """Replace the participant gauges (labels absent from the census go to 0)."""
        statuses = set(STATUSES) | {st for _, st in census.by_status}
        for side in SIDES:
            for st in statuses:
                self.participants.labels(side, st).set(census.by_status.get((side, st), 0))
        for _, name in AGE_BUCKETS:
            self.inflight.labels(name).set(census.inflight_by_age.get(name, 0))

    def set_findings(self, counts: dict[str, int]) -> None:
        for kind in sorted(set(FINDING_KINDS) | set(counts)):
            self.findings.labels(kind).set(counts.get(kind, 0))

    def set_engines(self, by_role: dict[str, int]) -> None:
        for role in sorted({"prefill", "decode"} | set(by_role)):
            self.engines.labels(role).set(by_role.get(role, 0))

    def count_reaped(self, entries: Iterable[Any]) -> None:
        """Count ledger entries (``room``, ``side``, ``status``): every participant, and
        each room once although its participants expire one by one, often in different
        sweeps (the last rooms seen are remembered for that)."""
        for e in entries:
            self.participants_reaped.labels(e.side, e.status).inc()
            if e.room is None or e.room in self._reaped_rooms:
                continue
            self._reaped_rooms[e.room] = None
            if len(self._reaped_rooms) > _REAPED_MEMORY:
                self._reaped_rooms.popitem(last=False)
            self.reaped.labels(e.status).inc()

    def set_transfers(self, by_engine: dict[str, TransferTotals]) -> None:
        """Replace the engines' published transfer totals (read from Redis by the monitor);
        what this process observed itself stays under engine="this-process"."""
        with self._transfers.lock:
            self._transfers.totals = dict(by_engine)
            if self._local.count:
                self._transfers.totals[LOCAL_ENGINE] = self._local

    def load_transfers(self, store: Store) -> None:
        """Read every engine's transfer counters from Redis (one SCAN, one pipeline)."""
        self.set_transfers(read_transfer_totals(store))

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A transfer made by this very process (engines in other processes publish
        theirs with :class:`TransferRecorder` instead)."""
        with self._transfers.lock:
            self._local.add(nbytes, seconds)
            self._transfers.totals[LOCAL_ENGINE] = self._local

    def render(self) -> bytes:
        """The text exposition format, as a scrape would return it."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve /metrics over HTTP from a daemon thread; returns the server. A port that
        is taken or not allowed is a :class:`MetricsPortError` saying what to do."""
        try:
            result = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = "is already in use (another monitor or exporter?)"
            elif exc.errno == errno.EACCES:
                why = "needs privileges (ports below 1024)"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = f"cannot be bound: {addr} is not an address of this host"
            else:
                why = f"cannot be bound ({exc.strerror or exc})"
            raise MetricsPortError(
                f"metrics port {addr}:{port} {why}; pick another with --metrics-port "
                "(0 picks a free one) or stop what holds it"
            ) from None
        return result[0] if isinstance(result, tuple) else result


DEFAULT = Metrics()


def observe_transfer(nbytes: int, seconds: float) -> None:
    """Record one transfer in this process's default metrics (``DEFAULT.serve(port)``
    exports it); engines that the monitor should see use :class:`TransferRecorder`."""
    DEFAULT.observe_transfer(nbytes, seconds)
