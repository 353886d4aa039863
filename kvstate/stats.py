"""An engine's transfer counters, kept in memory and published to Redis.

The writing half of the transfer metrics: a KVManager (core) records its transfers
here, and the monitor (``kvstate.ops.metrics``, which the core must not import)
reads every engine's hash back with :meth:`TransferTotals.parse`. Why the counters
go through Redis at all is told in that module's docstring.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvstate import schema
from kvstate.errors import KVStateError
from kvstate.store import Call, Store, command_call, pairs

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STATS_TTL_S = 24 * 3600  # an engine's counters outlive it by a day, then expire


@dataclass
class TransferTotals:
    """One engine's transfers since it started: bytes, count, seconds, and the latency
    histogram (count per bucket, not cumulative; the last slot is +Inf)."""

    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def add(self, nbytes: int, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self.bytes += max(0, int(nbytes))
        self.count += 1
        self.seconds += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def fields(self) -> dict[str, Any]:
        """The hash fields (readable with redis-cli: ``le:<bound>`` = transfers that took
        at most that many seconds and more than the previous bound)."""
        out: dict[str, Any] = {
            schema.STATS_BYTES: self.bytes,
            schema.STATS_COUNT: self.count,
            schema.STATS_SECONDS: repr(self.seconds),
        }
        for bound, n in zip((*LATENCY_BUCKETS, "+Inf"), self.buckets, strict=True):
            out[schema.le_field(bound)] = n
        return out

    @classmethod
    def parse(cls, raw: dict[Any, Any]) -> TransferTotals:
        h = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
        try:
            t = cls(
                int(h.get(schema.STATS_BYTES, 0)),
                int(h.get(schema.STATS_COUNT, 0)),
                float(h.get(schema.STATS_SECONDS, 0)),
            )
            for i, bound in enumerate((*LATENCY_BUCKETS, "+Inf")):
                t.buckets[i] = int(h.get(schema.le_field(bound), 0))
        except (ValueError, OverflowError):  # written by something else: export nothing
            return cls()  # rather than lie
        if min(t.bytes, t.count, t.seconds, *t.buckets) < 0 or t.seconds != t.seconds:
            return cls()
        return t


def publish_calls(key: str, fields: dict[str, Any], ttl_ms: int) -> list[Call]:
    """An engine's counters (absolute values) and their TTL, for one transaction."""
    return [
        command_call("HSET", key, args=pairs(fields)),
        command_call("PEXPIRE", key, args=[ttl_ms]),
    ]


def drop_call(store: Store, engine: str) -> Call:
    """Delete the counters an engine published, once they were read: a run that
    reports them itself (the demo) leaves no key behind."""
    return command_call("DEL", store.keys.transfer_stats(engine))


class TransferRecorder:
    """An engine's transfer counters, published to Redis for the monitor.

    ``observe()`` is cheap (memory only) and writes at most once per ``flush_interval``;
    ``close()`` writes the final figures. A failed write is logged and retried with
    the next one: metrics never break a transfer."""

    def __init__(
        self, store: Store, engine: str, flush_interval: float = 1.0, ttl: float = STATS_TTL_S
    ) -> None:
        self.store, self.engine = store, engine
        self.key = store.keys.transfer_stats(engine)
        self.flush_interval, self.ttl_ms = flush_interval, int(ttl * 1000)
        self.totals = TransferTotals()
        self._lock = threading.Lock()
        self._flushed = 0.0
        self._dirty = False

    def observe(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.totals.add(nbytes, seconds)
            self._dirty = True
            due = time.monotonic() - self._flushed >= self.flush_interval
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            fields = self.totals.fields()
            self._dirty = False
            self._flushed = time.monotonic()
        try:
            self.store.execute(publish_calls(self.key, fields, self.ttl_ms), transaction=True)
        except KVStateError as exc:
            log.warning("transfer counters of %s not published: %s", self.engine, exc)
            with self._lock:
                self._dirty = True

    def close(self) -> None:
        self.flush()
