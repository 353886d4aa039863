"""Counting round trips to Redis in this process (for tests and tools/bench_state.py).

Here, not in kvstate.testing, because it patches redis-py's connection class: only
kvstate.store imports redis-py. kvstate.testing re-exports it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.connection import AbstractConnection


class RoundTrips:
    """Counts writes to Redis sockets in this process: each is one request/response trip."""

    count = 0

    @classmethod
    @contextmanager
    def installed(cls) -> Iterator[type[RoundTrips]]:
        original = AbstractConnection.send_packed_command

        def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
            cls.count += 1
            original(self, command, check_health)  # type: ignore[no-untyped-call]

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        try:
            yield cls
        finally:
            AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
