"""Prometheus view of the state: gauges computed from Redis by the monitor, so they
survive engine crashes, plus a hook engines call for their own transfer stats.

Each ``Metrics`` has its own registry (never prometheus_client's global one), so
several can live in one process and tests scrape exactly what they set. No URL
or other secret is ever a label.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from kvstate.inspect import AGE_BUCKETS, STATUSES, Census
from kvstate.keys import SIDES

FINDING_KINDS: tuple[str, ...] = (
    "no_ttl",
    "terminal_uncleared",
    "stuck",
    "orphan_tracker",
    "unclaimed_xfer",
    "dead_engine",
    "dead_owner",
    "unindexed",
    "corrupt",
    "server_setting",
)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """All kvstate metrics in one private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.participants = Gauge(
            "kvstate_participants", "Participants stored, by side and status",
            ["side", "status"], registry=r)
        self.inflight = Gauge(
            "kvstate_inflight_participants",
            "Non-terminal participants by age since creation (server clock)", ["age"], registry=r)
        self.reaped = Counter(
            "kvstate_rooms_reaped",
            "Participants reaped by TTL (never cleared), by last status seen", ["status"],
            registry=r)
        self.findings = Gauge(
            "kvstate_audit_findings", "Findings of the latest audit, by kind", ["kind"],
            registry=r)
        self.engines = Gauge(
            "kvstate_engines_alive", "Engines holding a lease, by role", ["role"], registry=r)
        self.transfer_bytes = Counter(
            "kvstate_transfer_bytes", "KV bytes moved by this process's transports", registry=r)
        self.transfer_seconds = Histogram(
            "kvstate_transfer_seconds", "Latency of one room's transfer", registry=r,
            buckets=_LATENCY_BUCKETS)
        self.sweeps = Counter("kvstate_monitor_sweeps", "Monitor sweeps done", registry=r)

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

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(max(0, int(nbytes)))
        self.transfer_seconds.observe(max(0.0, float(seconds)))

    def render(self) -> bytes:
        """The text exposition format, as a scrape would return it."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve /metrics over HTTP from a daemon thread; returns the server."""
        result = start_http_server(port, addr=addr, registry=self.registry)
        return result[0] if isinstance(result, tuple) else result


DEFAULT = Metrics()


def observe_transfer(nbytes: int, seconds: float) -> None:
    """Record one room's transfer (bytes moved, seconds taken) in this process's
    metrics; roles and the demo call it, ``DEFAULT.serve(port)`` exports it."""
    DEFAULT.observe_transfer(nbytes, seconds)
