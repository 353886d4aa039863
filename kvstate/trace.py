"""The room trace: which rooms are traced, and what a trace entry holds.

A traced room's every transition (created, bound, published, each status, abort,
cleared) is appended by the script that makes it to the list
``kvstate:<ns>:{<room>}:trace`` (``Keys.trace``), one JSON object per entry stamped
with the Redis server's clock (design rule 9). The list is not deleted by ``clear()``:
it keeps its own TTL (``Options.trace_ttl``), refreshed by each entry, so an operator
can ask after the fact where a request's transfer spent its time (``kvstate trace
ROOM``). A list, not a stream: Redis 7 preallocates a stream's first node (4 KiB), so a
10-entry stream took 4.7 KB where the list takes under 1 KB. Its length is bounded by
the room (a few entries per participant and binding), so it needs no cap.
docs/design.md, Data model, says more.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvstate import schema

_MASK = 2**64 - 1
# W3C trace context, version 00: 00-<trace id: 32 hex>-<parent id: 16 hex>-<flags: 2 hex>
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def traceparent(value: object) -> str | None:
    """A serving request's W3C ``traceparent`` as kvstate keeps it (lower case), or
    None when ``value`` is none or not one (an all-zero id is invalid): what an
    integration hands ``KVManager.sender(..., trace_context=)`` from a request's
    headers, so a malformed header from a client never fails the request."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    m = _TRACEPARENT.fullmatch(text)
    if m is None or set(m[1]) == {"0"} or set(m[2]) == {"0"}:
        return None
    return text


def context_entry(side: str, engine: str, context: str) -> str:
    """The trace entry that carries a request's trace context (schema.EV_CONTEXT)."""
    doc = {
        schema.TRACE_MS: 0,
        schema.TRACE_SIDE: side,
        schema.TRACE_ENGINE: engine,
        schema.TRACE_EVENT: schema.EV_CONTEXT,
        schema.TRACE_PARENT: context,
    }
    return json.dumps(doc, separators=(",", ":"))


def _mix(room: int) -> int:
    """SplitMix64's finalizer: a 64-bit integer hash, the same in every process and
    language (Python's ``hash()`` is salted per process), that spreads consecutive
    room ids evenly."""
    z = (room + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sampled(room: int, rate: float) -> bool:
    """Whether ``room`` is traced at ``rate`` (in [0, 1]): a pure function of the room
    id, so the prefill and decode sides of a room (and ``kvstate trace``) agree
    without talking to each other when they run at the same rate."""
    if rate >= 1:
        return True
    if rate <= 0:
        return False
    return _mix(room) < rate * 2**64


@dataclass(frozen=True)
class TraceEntry:
    """One entry of a room's trace: ``ms`` the server clock, ``seq`` its order among
    the entries of that ms; ``side`` tx / rx ('' for the room itself: an abort that
    found nobody), ``engine`` the participant's engine, ``event`` one of created,
    bound, published, a status name (WaitingForInput, Transferring, Success, Failed),
    abort, cleared; ``fields`` the rest (status, reason, peer, incarnation, was)."""

    ms: int
    seq: int
    side: str
    engine: str
    event: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.ms}-{self.seq}"

    @classmethod
    def parse_all(cls, raw: list[Any]) -> list[TraceEntry]:
        """The entries of an LRANGE of the trace, in order; an entry that does not
        parse (no kvstate code wrote it) is kept as an event named ``unreadable``."""
        out: list[TraceEntry] = []
        last: TraceEntry | None = None  # the last step (a context entry is none)
        for item in raw:
            e = cls.parse(item)
            seq = last.seq + 1 if last is not None and last.ms == e.ms else 0
            entry = cls(e.ms, seq, e.side, e.engine, e.event, e.fields)
            out.append(entry)
            if e.event != schema.EV_CONTEXT:
                last = entry
        return out

    @classmethod
    def parse(cls, raw: Any) -> TraceEntry:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError(text)
            fields = {str(k): _text(v) for k, v in doc.items()}
            ms = schema.parse_count(_text(doc.get(schema.TRACE_MS, "0")), 0, 2**53)
            if ms is None:
                raise ValueError(text)
        except (ValueError, RecursionError):  # not kvstate's JSON (an ms that is no count)
            return cls(0, 0, "", "", "unreadable", {"raw": text[:200]})
        fields.pop(schema.TRACE_MS, None)
        side = fields.pop(schema.TRACE_SIDE, "")
        engine = fields.pop(schema.TRACE_ENGINE, "")
        event = fields.pop(schema.TRACE_EVENT, "")
        return cls(ms, 0, side, engine, event, fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "ms": self.ms,
            "side": self.side,
            "engine": self.engine,
            "event": self.event,
            **self.fields,
        }


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else str(value)
