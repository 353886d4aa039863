"""Deadlines: every kvstate call runs under one, and every wait on Redis is cut to it.

Every kvstate call runs under one ``deadline`` (``Options.call_timeout``): the retry
policy stops and every socket wait is cut when it passes, because redis-py's own
timeouts multiply (handshake retries inside command retries: ~190 s on a stalled
server with 5 s timeouts and 5 retries). Also here: the errors that waiting cannot
fix (a refused TLS handshake, a server at maxclients), which the retry policy and the
error messages both need to tell apart.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import redis
from redis.backoff import AbstractBackoff
from redis.exceptions import AuthenticationError, MaxConnectionsError
from redis.retry import Retry

from kvstate.store import redispy_private as private

_POOL_POLL_S = 0.05  # s: a waiting call looks at the pool again at least this often

# The monotonic time by which the Redis work of the current call must end (None: no
# call in progress in this thread). Set by ``deadline()``; read by the retry policy and
# by every connection, which shorten their waits to what is left.
_DEADLINE: ContextVar[float | None] = ContextVar("kvstate_deadline", default=None)


class DeadlineExceeded(redis.TimeoutError):
    """The call's time (``Options.call_timeout``) ran out before Redis answered."""


class deadline:  # noqa: N801 - used like a function: ``with deadline(5):``
    """Bound all Redis work in this block (this thread) to end within ``seconds``: every
    connect, read, write, retry and backoff is cut to the time left, then raises
    DeadlineExceeded. A nested block keeps the outer deadline when that one is earlier,
    so a public call made of several round trips is bounded as a whole. (A class, not
    a generator: it wraps every call on the hot path.)"""

    __slots__ = ("seconds", "_token")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._token: Token[float | None] | None = None

    def __enter__(self) -> float:
        end = time.monotonic() + self.seconds
        outer = _DEADLINE.get()
        if outer is not None and outer <= end:
            return outer
        self._token = _DEADLINE.set(end)
        return end

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _DEADLINE.reset(self._token)
            self._token = None


class paused:  # noqa: N801 - used like a function: ``with paused():``
    """Stop the current call's clock for a block that waits on something other than
    Redis (a transport's write, bounded by its own timeout): the call's Redis work
    before and after it still shares one ``call_timeout``."""

    __slots__ = ("_left", "_token")

    def __enter__(self) -> None:
        self._left = time_left()
        self._token = _DEADLINE.set(None)

    def __exit__(self, *exc: object) -> None:
        _DEADLINE.reset(self._token)
        if self._left is not None:
            _DEADLINE.set(time.monotonic() + self._left)


def time_left() -> float | None:
    """Seconds left to the current call's deadline; None outside of one."""
    end = _DEADLINE.get()
    return None if end is None else end - time.monotonic()


def _bounded_wait(base: float | None) -> float | None:
    """``base`` (a socket timeout) cut to the deadline; raises once it has passed."""
    left = time_left()
    if left is None:
        return base
    if left <= 0:
        raise DeadlineExceeded("no answer within the call's time limit (Options.call_timeout)")
    return left if base is None else min(base, left)


class DeadlineBoundConnection(private.SocketOpener):
    """Mixed into redis-py's connection classes: each socket wait is cut to what is left
    of the current call's deadline, so one stalled read cannot outlast the call."""

    socket_timeout: float | None
    socket_connect_timeout: float | None
    _applied: float | None = None

    def open_socket(self, connect: Callable[[], Any]) -> Any:
        saved = self.socket_connect_timeout, self.socket_timeout
        self.socket_connect_timeout = _bounded_wait(saved[0])
        self.socket_timeout = _bounded_wait(saved[1])
        try:
            sock = connect()
            self._applied = self.socket_timeout
            return sock
        finally:
            self.socket_connect_timeout, self.socket_timeout = saved

    def bound_socket(self) -> None:
        """Cut the socket's timeout to what is left of the call (kvstate.store.wire calls it
        before each wait of the lean round trip)."""
        wait = _bounded_wait(self.socket_timeout)
        sock = private.socket_of(self)
        if sock is not None and wait != self._applied:
            sock.settimeout(wait)
            self._applied = wait

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self.bound_socket()
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self.bound_socket()
        if "timeout" not in kwargs:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        finally:  # the parser applied its own timeout, then put back socket_timeout
            self._applied = self.socket_timeout

    def can_read(self, timeout: float = 0) -> bool:
        try:
            return bool(super().can_read(timeout))  # type: ignore[misc]
        finally:  # as in read_response(timeout=...)
            self._applied = self.socket_timeout


_BOUNDED: dict[type, type] = {}


class BoundedPool(redis.ConnectionPool):
    """A pool whose connections are ``DeadlineBoundConnection`` variants of the class redis-py
    picked for the URL (TCP, TLS or unix socket); Cluster nodes get it too. When all of its
    connections are in use (redis-py's ``max_connections``), a call waits for one to come
    back, within its deadline, instead of failing at once: a scheduler's threads share
    the pool, and a busy moment is not an error."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return super().get_connection(*args, **kwargs)
            except MaxConnectionsError:
                left = time_left()
                if left is None or left <= 0:
                    raise
                with self._freed:
                    self._freed.wait(min(left, _POOL_POLL_S))

    def release(self, connection: Any) -> None:
        super().release(connection)
        with self._freed:
            self._freed.notify()

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        self._freed = threading.Condition()
        bounded = _BOUNDED.get(connection_class)
        if bounded is None and issubclass(connection_class, DeadlineBoundConnection):
            bounded = connection_class  # a copy of a pool that is bounded already
        if bounded is None:
            name = f"Bounded{connection_class.__name__}"
            bounded = _BOUNDED[connection_class] = type(
                name, (DeadlineBoundConnection, connection_class), {}
            )
        super().__init__(connection_class=bounded, **kwargs)


def is_tls_refusal(exc: BaseException) -> bool:
    """A TLS handshake that failed (a wrong CA, or a server that does not speak TLS):
    waiting cannot fix it. redis-py keeps the ssl.SSLError as the context of its
    ConnectionError, and its text in the message."""
    return _in_chain(exc, lambda e: isinstance(e, ssl.SSLError) or "[SSL" in str(e))


MAXCLIENTS = "max number of clients reached"  # what Redis answers a connection over maxclients


def refused_for_maxclients(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is Redis refusing a new connection
    at its ``maxclients`` limit."""
    return _in_chain(exc, lambda e: MAXCLIENTS in str(e))


def _in_chain(exc: BaseException, test: Callable[[BaseException], bool]) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if test(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


class Capped(AbstractBackoff):
    """A backoff never longer than what is left of the call: a pause that outlasts the
    deadline would only end in DeadlineExceeded, later than ``call_timeout``."""

    def __init__(self, inner: AbstractBackoff) -> None:
        self.inner = inner

    def reset(self) -> None:
        self.inner.reset()  # type: ignore[no-untyped-call]

    def compute(self, failures: int) -> float:
        pause = float(self.inner.compute(failures))
        left = time_left()
        return pause if left is None else max(0.0, min(pause, left))


class BoundedRetry(Retry):
    """redis-py's retry, within the call's deadline (one of ``call_timeout`` when none is
    running yet), and never for what waiting cannot fix: a wrong password (redis-py's
    AuthenticationError is a ConnectionError) or a refused TLS handshake. A deadline
    that runs out is raised from the error that was retried (a server at maxclients
    says so, not only that time ran out)."""

    def __init__(self, backoff: Any, retries: int, call_timeout: float) -> None:
        super().__init__(backoff, retries)
        self.call_timeout = call_timeout

    def call_with_retry(
        self,
        do: Callable[[], Any],
        fail: Any,
        is_retryable: Any = None,
        with_failure_count: bool = False,
    ) -> Any:
        last: list[Exception] = []

        def retryable(exc: Exception) -> bool:
            if isinstance(exc, DeadlineExceeded):
                if last and exc.__cause__ is None:
                    exc.__cause__ = last[0]
                return False
            last[:] = [exc]
            if isinstance(exc, AuthenticationError) or is_tls_refusal(exc):
                return False
            left = time_left()
            if left is not None and left <= 0:
                return False
            return is_retryable is None or bool(is_retryable(exc))

        if _DEADLINE.get() is not None:  # inside a kvstate call: its deadline holds
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        with deadline(self.call_timeout):
            return super().call_with_retry(do, fail, retryable, with_failure_count)
