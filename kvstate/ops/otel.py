"""Room traces in OpenTelemetry: each traced room that ended, as spans over OTLP.

The engines never export anything: the room trace they already keep in Redis
(kvstate.trace, no round trip added) is read back by ``kvstate monitor`` once the room
ended (its room hash is gone: every participant cleared or expired), and exported from
there, off the engines' hot path. One trace per room: a root span ``kvstate room`` from
its first step to its last, one child span per phase (bootstrap, waiting for input,
transfer, until clear, ``... until failure``: kvstate.ops.timeline), every abort and
failure a span event with its reason, and a link to each serving request's trace whose
context an engine passed (``KVManager.sender(..., trace_context=)``).

Configured the standard way: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), OTLP over HTTP/protobuf, ``OTEL_SERVICE_NAME``
(default ``kvstate``), ``OTEL_RESOURCE_ATTRIBUTES``, the exporter's headers and
timeouts; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off. The
SDK and the exporter are the ``[otel]`` extra, imported only when configured.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvstate.errors import UnsupportedConfigError
from kvstate.ops.timeline import TERMINAL_FAILURE, Timeline, timeline_calls, timeline_of
from kvstate.store import Store

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXTRA = "pip install 'kvstate[otel]'"
_MEMORY = 100_000  # rooms remembered as exported (their traces live for trace_ttl)


def endpoint() -> str | None:
    """The OTLP endpoint the environment names, or None when export is not asked for
    (no endpoint, ``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none``)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return next((v for k in ENDPOINT_VARS if (v := os.environ.get(k, "").strip())), None)


@dataclass(frozen=True)
class SpanPlan:
    """One span to export: times in server ms, attributes, events (name, ms, attrs)."""

    name: str
    start_ms: int
    end_ms: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)


def plan(t: Timeline, namespace: str) -> tuple[SpanPlan, list[SpanPlan]]:
    """The root span and the phase spans of one room's timeline (pure: no SDK)."""
    failed = t.failure is not None
    root = SpanPlan(
        "kvstate room",
        t.start_ms,
        t.start_ms + t.total_ms,
        {
            "kvstate.room": str(t.room),  # 63-bit ids: text, as some backends take int53
            "kvstate.namespace": namespace,
            "kvstate.outcome": "failed" if failed else t.outcome,
            "kvstate.steps": len(t.entries),
        },
    )
    for e in t.entries:
        if e.event in TERMINAL_FAILURE:
            attrs = {"kvstate.side": e.side, "kvstate.engine": e.engine}
            attrs.update({f"kvstate.{k}": v for k, v in sorted(e.fields.items())})
            root.events.append((f"kvstate.{e.event.lower()}", e.ms, attrs))
    phases = [
        SpanPlan(p.name, p.start_ms, p.end_ms, {"kvstate.phase": phase_label(p.name)})
        for p in t.phases()
    ]
    return root, phases


def phase_label(name: str) -> str:
    """A phase's name as a metric label or attribute: ``waiting_for_input``; a phase a
    failure ended is named as the phase (the room's outcome says it failed)."""
    return name.removesuffix(" until failure").replace(" ", "_")


class RoomExporter:
    """Exports rooms' timelines as spans, in the background (the SDK's batch span
    processor); ``close()`` flushes what is queued. ``span_exporter``: where spans go
    (default: OTLP over HTTP, from the environment)."""

    def __init__(self, span_exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise UnsupportedConfigError(
                f"an OTLP endpoint is set ({' or '.join(ENDPOINT_VARS)}) but OpenTelemetry's "
                f"SDK is not installed: {EXTRA}, or unset the variable"
            ) from None
        if span_exporter is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                raise UnsupportedConfigError(
                    f"OpenTelemetry's OTLP/HTTP exporter is not installed: {EXTRA}"
                ) from None
            span_exporter = OTLPSpanExporter()
        given = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "kvstate"}
        self.provider = TracerProvider(resource=Resource.create(given))
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter))
        self.tracer = self.provider.get_tracer("kvstate")
        self.exported = 0

    def export(self, t: Timeline, namespace: str) -> None:
        """One room as one trace: its root span, a child span per phase, its failures as
        events, links to the serving requests' traces."""
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

        root_plan, phases = plan(t, namespace)
        links = []
        for side, engine, tp in t.contexts:
            _, trace_id, span_id, flags = tp.split("-")
            ctx = SpanContext(int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)))
            links.append(Link(ctx, {"kvstate.side": side, "kvstate.engine": engine}))
        root = self.tracer.start_span(
            root_plan.name,
            context=Context(),  # a trace of its own, whatever the caller's context
            attributes=root_plan.attributes,
            links=links,
            start_time=_ns(root_plan.start_ms),
        )
        for name, ms, attrs in root_plan.events:
            root.add_event(name, attrs, timestamp=_ns(ms))
        if t.failure is not None:
            root.set_status(Status(StatusCode.ERROR, t.outcome))
        parent = trace.set_span_in_context(root)
        for p in phases:
            span = self.tracer.start_span(
                p.name, context=parent, attributes=p.attributes, start_time=_ns(p.start_ms)
            )
            span.end(end_time=_ns(p.end_ms))
        root.end(end_time=_ns(root_plan.end_ms))
        self.exported += 1

    def close(self) -> None:
        """Send what is queued and stop (bounded by the SDK's export timeout)."""
        self.provider.shutdown()


def _ns(ms: int) -> int:
    return ms * 1_000_000


class EndedRooms:
    """The traced rooms that ended since ``since_ms`` (server clock), each once: a trace
    whose room hash is gone (its participants cleared or expired). Each ``poll()`` is a
    SCAN of the traces and one batch of reads (LRANGE, PTTL, EXISTS of the room hash)
    for the rooms not handed out yet."""

    def __init__(self, store: Store, since_ms: int) -> None:
        self.store = store
        self.since_ms = since_ms
        self._done: OrderedDict[int, None] = OrderedDict()

    def poll(self) -> list[Timeline]:
        s, k = self.store, self.store.keys
        rooms = []
        for key in s.scan(k.trace_pattern):
            parsed = k.parse_room_key(key)
            if parsed is not None and parsed.room not in self._done:
                rooms.append(parsed.room)
        out = []
        for start in range(0, len(rooms), 500):
            chunk = rooms[start : start + 500]
            calls = [timeline_calls(s, room) for room in chunk]
            read = s.execute([c for per in calls for c in per], partial=True)
            n = len(calls[0])
            for i, room in enumerate(chunk):
                raw, ttl, listed, stored = read[n * i : n * i + n]
                if isinstance(listed, Exception) or int(listed):
                    continue  # still live: its trace grows (or its room hash is no hash)
                length = stored if isinstance(stored, int) else 0
                t = timeline_of(room, raw, int(ttl), live=False, stored=length)
                self._remember(room)
                if t.entries and t.entries[-1].ms >= self.since_ms:
                    out.append(t)
        return out

    def _remember(self, room: int) -> None:
        self._done[room] = None
        if len(self._done) > _MEMORY:
            self._done.popitem(last=False)


__all__ = [
    "ENDPOINT_VARS",
    "EndedRooms",
    "RoomExporter",
    "SpanPlan",
    "endpoint",
    "phase_label",
    "plan",
]
