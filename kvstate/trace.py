"""The room trace: which rooms are traced, and what a trace entry holds.

A traced room's every transition (created, bound, published, each status, abort,
cleared) is appended by the script that makes it to the capped stream
``kvstate:<ns>:{<room>}:trace`` (``Keys.trace``), whose entry ids are the Redis
server's clock (design rule 9). The stream is not deleted by ``clear()``: it keeps its
own TTL (``Options.trace_ttl``), refreshed by each entry, so an operator can ask after
the fact where a request's transfer spent its time (``kvstate trace ROOM``).
docs/design.md, Data model, says more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstate import schema

# Entries kept per room, roughly (XADD MAXLEN ~): a room of 8 senders and 8 receivers
# writes about 140. Mirrored by TRACE_MAXLEN in scripts/_lib.lua (tests/test_trace.py).
TRACE_MAXLEN = 1000

_MASK = 2**64 - 1


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
    """One entry of a room's trace: ``ms`` and ``seq`` are the stream id (the server
    clock, and the order within that ms); ``side`` tx / rx ('' for the room itself:
    an abort that found nobody), ``engine`` the participant's engine, ``event`` one of
    created, bound, published, a status name (WaitingForInput, Transferring, Success,
    Failed), abort, cleared; ``fields`` the rest (status, reason, peer, incarnation)."""

    ms: int
    seq: int
    side: str
    engine: str
    event: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.ms}-{self.seq}"

    @property
    def who(self) -> str:
        return f"{self.side}:{self.engine}" if self.side else "room"

    @classmethod
    def parse(cls, raw_id: Any, raw: Any) -> TraceEntry:
        """An XRANGE entry (id, [field, value, ...] or {field: value}) as redis-py
        returns it; unknown fields are kept, missing ones read ''."""
        text = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        ms, _, seq = text.partition("-")
        items = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
        fields = {_text(k): _text(v) for k, v in items}
        side = fields.pop(schema.TRACE_SIDE, "")
        engine = fields.pop(schema.TRACE_ENGINE, "")
        event = fields.pop(schema.TRACE_EVENT, "")
        return cls(int(ms), int(seq or 0), side, engine, event, fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ms": self.ms,
            "side": self.side,
            "engine": self.engine,
            "event": self.event,
            **self.fields,
        }


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
