"""Redis URLs and clients: parsing, redaction, timeouts and retry policy.

A URL is shown only through ``redact()``: the password never reaches a log line,
an exception or a repr (design rule 8).

Every kvstate call runs under one ``deadline`` (``Options.call_timeout``): the retry
policy stops and every socket wait is cut when it passes, because redis-py's own
timeouts multiply (handshake retries inside command retries: ~190 s on a stalled
server with 5 s timeouts and 5 retries).
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from kvstate import redispy_private as private
from kvstate.defaults import CALL_TIMEOUT, TRACE_RATE, TRACE_TTL
from kvstate.errors import InvalidOptionError, InvalidURLError

ENV_URL = "KVSTATE_REDIS_URL"
ENV_NAMESPACE = "KVSTATE_NAMESPACE"
# The password for a URL that has none: a secret with `@`, `/` or `:` in it cannot be
# pasted into a URL unescaped (docker-compose passes it this way).
ENV_PASSWORD = "KVSTATE_REDIS_PASSWORD"
_SCHEMES = {"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"}

Client = redis.Redis | RedisCluster

# The monotonic time by which the Redis work of the current call must end (None: no
# call in progress in this thread). Set by ``deadline()``; read by the retry policy and
# by every connection, which shorten their waits to what is left.
_DEADLINE: ContextVar[float | None] = ContextVar("kvstate_deadline", default=None)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``; unparseable input is hidden whole."""
    try:
        base, mark, query = url.partition("?")
        if query:  # a password given as a query parameter (not supported, but shown)
            pairs = [p.partition("=") for p in query.split("&")]
            query = "&".join(
                f"{k}{eq}***" if "pass" in k.lower() else f"{k}{eq}{v}" for k, eq, v in pairs
            )
        parts = urlsplit(base)
        if parts.password:  # an empty one is no secret: shown as given
            host = parts.netloc.rpartition("@")[2]
            base = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
        return base + mark + query
    except ValueError:
        return "<unparseable URL>"


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
        """Cut the socket's timeout to what is left of the call (kvstate.wire calls it
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


class _BoundedPool(redis.ConnectionPool):
    """A pool whose connections are ``DeadlineBoundConnection`` variants of the class redis-py
    picked for the URL (TCP, TLS or unix socket); Cluster nodes get it too."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        bounded = _BOUNDED.get(connection_class)
        if bounded is None and issubclass(connection_class, DeadlineBoundConnection):
            bounded = connection_class  # a copy of a pool that is bounded already
        if bounded is None:
            name = f"Bounded{connection_class.__name__}"
            bounded = _BOUNDED[connection_class] = type(
                name, (DeadlineBoundConnection, connection_class), {}
            )
        super().__init__(connection_class=bounded, **kwargs)


@dataclass(frozen=True)
class Options:
    """Client behaviour; the defaults suit an engine on a healthy LAN.

    ``call_timeout`` bounds each kvstate call as a whole (every round trip, reconnect,
    retry and backoff in it): past it the call raises StateConnectionError. The socket
    timeouts bound one wait on the network, ``retries`` how often a failed round trip
    is tried again within the call's time. ``durable``: a call that records Success or
    an abort answers only once a replica confirmed it (``WAIT``), else raises
    DurabilityError (docs/design.md, Durable mode). ``trace_rate``: the share of rooms
    whose every transition is kept in a trace list (``kvstate trace ROOM``), chosen
    by the room id so that every process with the same rate picks the same rooms;
    ``trace_ttl``: seconds a trace outlives its last entry (docs/design.md, Data model).
    """

    socket_timeout: float = 5.0
    connect_timeout: float = 5.0
    retries: int = 5
    backoff_base: float = 0.05
    backoff_cap: float = 1.0
    health_check_interval: int = 10
    call_timeout: float = CALL_TIMEOUT
    durable: bool = False
    trace_rate: float = TRACE_RATE
    trace_ttl: float = TRACE_TTL

    def __post_init__(self) -> None:
        for name in ("socket_timeout", "connect_timeout", "call_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidOptionError(f"Options.{name} must be a number > 0, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise InvalidOptionError(f"Options.retries must be an int >= 0, got {self.retries!r}")
        if not isinstance(self.durable, bool):
            raise InvalidOptionError(f"Options.durable must be True or False, got {self.durable!r}")
        rate = self.trace_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise InvalidOptionError(
                f"Options.trace_rate must be a number in [0, 1] (0.01: one room in 100), "
                f"got {rate!r}"
            )
        ttl = self.trace_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl < 2**31:
            raise InvalidOptionError(
                f"Options.trace_ttl must be a number of seconds >= 1, got {ttl!r}"
            )

    def retry(self) -> Retry:
        backoff = _Capped(ExponentialWithJitterBackoff(self.backoff_cap, self.backoff_base))
        return _BoundedRetry(backoff, self.retries, self.call_timeout)


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


class _Capped(AbstractBackoff):
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


class _BoundedRetry(Retry):
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


# URL query parameters kvstate reads (and what they set); anything else is refused.
_FLOAT_PARAMS = {
    "socket_timeout": "socket_timeout",
    "connect_timeout": "connect_timeout",
    "socket_connect_timeout": "connect_timeout",
    "call_timeout": "call_timeout",
}
_TLS_PARAMS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
SUPPORTED_PARAMS = (
    "cluster",
    "db",
    "durable",
    *_FLOAT_PARAMS,
    "retries",
    "trace_rate",
    "trace_ttl",
    *sorted(_TLS_PARAMS),
)


@dataclass(frozen=True)
class _Parsed:
    parts: SplitResult
    cluster: bool
    options: dict[str, Any]  # Options fields set in the URL
    client: dict[str, Any]  # redis-py keyword arguments (db, TLS files)


def _query(url: str, parts: SplitResult) -> tuple[bool | None, dict[str, Any], dict[str, Any]]:
    """(cluster, Options fields, redis-py kwargs) from the URL's query string."""
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise InvalidURLError(f"malformed query string in Redis URL {redact(url)}") from None
    cluster: bool | None = None
    options: dict[str, Any] = {}
    client: dict[str, Any] = {}
    supported = ", ".join(SUPPORTED_PARAMS)
    for name, values in query.items():
        if len(values) != 1:
            raise InvalidURLError(f"parameter {name!r} appears more than once in {redact(url)}")
        value = values[0]
        bad = InvalidURLError(f"bad value {value!r} for {name!r} in Redis URL {redact(url)}")
        if name in ("cluster", "durable", "ssl_check_hostname"):
            if value.lower() not in _BOOLS:
                raise InvalidURLError(f"{bad}: use true or false")
            if name == "cluster":
                cluster = _BOOLS[value.lower()]
            elif name == "durable":
                options[name] = _BOOLS[value.lower()]
            else:
                client[name] = _BOOLS[value.lower()]
        elif name in _FLOAT_PARAMS:
            try:
                seconds = float(value)
            except ValueError:
                raise InvalidURLError(f"{bad}: use a number of seconds, e.g. 5") from None
            if not 0 < seconds < float("inf"):
                raise InvalidURLError(f"{bad}: use a number of seconds > 0")
            options[_FLOAT_PARAMS[name]] = seconds
        elif name in ("trace_rate", "trace_ttl"):
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if name == "trace_rate" and not 0 <= number <= 1:
                raise InvalidURLError(f"{bad}: use a share of rooms in [0, 1], e.g. 0.01")
            if name == "trace_ttl" and not 1 <= number < 2**31:
                raise InvalidURLError(f"{bad}: use a number of seconds >= 1, e.g. 3600")
            options[name] = number
        elif name in ("retries", "db"):
            if not value.isdigit():
                raise InvalidURLError(f"{bad}: use an integer >= 0")
            (options if name == "retries" else client)[name] = int(value)
        elif name in _TLS_PARAMS:
            if not parts.scheme.startswith("rediss"):
                raise InvalidURLError(
                    f"{name!r} in {redact(url)} needs TLS: use rediss:// (or rediss+cluster://)"
                )
            if name == "ssl_cert_reqs" and value not in ("none", "optional", "required"):
                raise InvalidURLError(f"{bad}: use none, optional or required")
            client[name] = value
        else:
            raise InvalidURLError(
                f"unknown parameter {name!r} in Redis URL {redact(url)}; kvstate reads "
                f"only: {supported}"
            )
    return cluster, options, client


def _check(url: object, cluster: bool | None) -> _Parsed:
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"Redis URL must be a non-empty string, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidURLError(f"malformed Redis URL {redact(url)}: {exc}") from None
    if "sentinel" in parts.scheme:
        raise InvalidURLError(
            f"Redis Sentinel ({redact(url)}) is not supported: kvstate does not follow a "
            "Sentinel failover. Give the current primary's redis:// URL, or use a Redis "
            "Cluster (redis+cluster://), which kvstate follows across failovers"
        )
    if parts.scheme not in _SCHEMES:
        raise InvalidURLError(
            f"unsupported scheme in {redact(url)}; use redis://, rediss://, unix:// "
            "or redis+cluster://"
        )
    in_url, options, client = _query(url, parts)
    is_cluster = parts.scheme.endswith("+cluster") or bool(cluster) or bool(in_url)
    if parts.scheme == "unix":
        if not parts.path:
            raise InvalidURLError(f"unix URL {redact(url)} has no socket path")
        if is_cluster:
            raise InvalidURLError("a Redis Cluster is reached over TCP, not a unix socket")
    elif not parts.hostname:
        raise InvalidURLError(f"Redis URL {redact(url)} has no host")
    if port == 0:
        raise InvalidURLError(f"Redis URL {redact(url)} has port 0")
    db = parts.path.strip("/") if parts.scheme != "unix" else ""
    if db and not db.isdigit():
        raise InvalidURLError(f"database in {redact(url)} must be a number, got {db!r}")
    if db and "db" in client:
        raise InvalidURLError(f"{redact(url)} names its database twice (path and ?db=)")
    if is_cluster and int(db or client.get("db", 0)) != 0:
        raise InvalidURLError(f"a Redis Cluster has only database 0, not {redact(url)}")
    return _Parsed(parts, is_cluster, options, client)


def effective_options(url: str, options: Options | None = None) -> Options:
    """``options`` (or the defaults) with the fields the URL's query sets replaced."""
    return replace(options or Options(), **_check(url, None).options)


def make_client(url: str, cluster: bool | None = None, options: Options | None = None) -> Client:
    """A redis-py client (standalone or Cluster) for ``url``; bytes in, bytes out.
    Parameters in the URL's query override ``options`` field by field."""
    parsed = _check(url, cluster)
    opts = replace(options or Options(), **parsed.options)
    common: dict[str, Any] = {
        "socket_timeout": opts.socket_timeout,
        "socket_connect_timeout": opts.connect_timeout,
        "retry": opts.retry(),
        "client_name": f"kvstate-{os.getpid()}",
        "connection_pool_class": _BoundedPool,
        **parsed.client,
    }
    # the query is ours (read above); redis-py would let it override these settings
    plain = url.partition("?")[0].replace("+cluster://", "://", 1)
    if os.environ.get(ENV_PASSWORD) and not urlsplit(plain).password:
        common["password"] = os.environ[ENV_PASSWORD]
    if parsed.cluster:
        # A Cluster has database 0 only (checked above): redis-py refuses a ``db``
        # argument there, and every client made from this one's settings inherits it.
        common.pop("db", None)
        plain = urlunsplit(urlsplit(plain)._replace(path=""))
        return RedisCluster.from_url(plain, **common)
    common.pop("connection_pool_class")
    pool = _BoundedPool.from_url(plain, health_check_interval=opts.health_check_interval, **common)
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def answers_plain_text(url: str, timeout: float) -> bool:
    """Whether the server of a ``rediss://`` URL answers a plain-text PING (it does not
    speak TLS on that port). Asked before the TLS handshake, which would otherwise wait
    for a reply a plain redis-server never sends (it waits for the end of a line)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "", parts.port or 6379), timeout=timeout
        ) as sock:
            sock.sendall(b"PING\r\n")
            first = sock.recv(1)
    except OSError:
        return False  # unreachable, or a TLS server hung up: the TLS attempt will tell
    return first in (b"+", b"-")  # +PONG, or -NOAUTH / -ERR: a RESP reply


def check_url(url: str, cluster: bool | None = None) -> bool:
    """Validate ``url``; returns whether it names a Cluster."""
    return _check(url, cluster).cluster
