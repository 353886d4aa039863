"""Redis URLs and clients: parsing, redaction, options and the clients made from them.

A URL is shown only through ``redact()``: the password never reaches a log line,
an exception or a repr (design rule 8). The deadline every call runs under, and the
sockets and retries bound by it, are ``kvstate.store.deadline``'s.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvstate.defaults import CALL_TIMEOUT, TRACE_RATE, TRACE_TTL
from kvstate.errors import InvalidOptionError, InvalidURLError
from kvstate.store.deadline import BoundedPool, BoundedRetry, Capped

ENV_URL = "KVSTATE_REDIS_URL"
ENV_NAMESPACE = "KVSTATE_NAMESPACE"
# The password for a URL that has none: a secret with `@`, `/` or `:` in it cannot be
# pasted into a URL unescaped (docker-compose passes it this way).
ENV_PASSWORD = "KVSTATE_REDIS_PASSWORD"
_SCHEMES = {"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"}

Client = redis.Redis | RedisCluster


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
    ``notices``: a KVManager subscribes to its engine's change notices, so that a step
    polls only the waiting rooms another participant changed (issue 33, target 3);
    ``notice_sweep``: seconds after which a waiting room is polled anyway, notice or
    not (its timeouts fire within it; lost notices cost at most that long).
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
    notices: bool = True
    notice_sweep: float = 1.0

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
        if not isinstance(self.notices, bool):
            raise InvalidOptionError(f"Options.notices must be True or False, got {self.notices!r}")
        sweep = self.notice_sweep
        if isinstance(sweep, bool) or not isinstance(sweep, (int, float)) or not 0 < sweep <= 3600:
            raise InvalidOptionError(
                f"Options.notice_sweep must be a number of seconds in (0, 3600], got {sweep!r}"
            )
        ttl = self.trace_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl < 2**31:
            raise InvalidOptionError(
                f"Options.trace_ttl must be a number of seconds >= 1, got {ttl!r}"
            )

    def retry(self) -> Retry:
        backoff = Capped(ExponentialWithJitterBackoff(self.backoff_cap, self.backoff_base))
        return BoundedRetry(backoff, self.retries, self.call_timeout)


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
        "connection_pool_class": BoundedPool,
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
    pool = BoundedPool.from_url(plain, health_check_interval=opts.health_check_interval, **common)
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
