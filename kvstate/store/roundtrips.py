"""Counting round trips to Redis in this process (for tests and tools/bench_state.py).

Here, not in kvstate.testing, because it patches redis-py's connection class: only
kvstate.store imports redis-py. kvstate.testing re-exports it."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.connection import AbstractConnection


class RoundTrips:
    """Counts writes to Redis sockets in this process: each is one request/response trip.
    ``by_thread`` splits them by thread name: a KVManager's heartbeat runs in a thread of
    its own (``kvstate-<engine>``), whose trips come every heartbeat interval, not per
    call, and land in ``count`` too when a counted step outlasts that interval."""

    count = 0
    by_thread: Counter[str] = Counter()

    @classmethod
    @contextmanager
    def installed(cls) -> Iterator[type[RoundTrips]]:
        original = AbstractConnection.send_packed_command

        def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
            cls.count += 1
            cls.by_thread[threading.current_thread().name] += 1
            original(self, command, check_health)  # type: ignore[no-untyped-call]

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        try:
            yield cls
        finally:
            AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
