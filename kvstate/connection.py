"""Redis URLs and clients: parsing, redaction, timeouts and retry policy.

A URL is shown only through ``redact()``: the password never reaches a log line,
an exception or a repr (SPEC rule 8).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from kvstate.errors import InvalidURLError

ENV_URL = "KVSTATE_REDIS_URL"
ENV_NAMESPACE = "KVSTATE_NAMESPACE"
_SCHEMES = {"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"}

Client = redis.Redis | RedisCluster


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``; unparseable input is hidden whole."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparseable URL>"


@dataclass(frozen=True)
class Options:
    """Client behaviour; the defaults suit an engine on a healthy LAN."""

    socket_timeout: float = 5.0
    connect_timeout: float = 5.0
    retries: int = 5
    backoff_base: float = 0.05
    backoff_cap: float = 1.0
    health_check_interval: int = 10

    def retry(self) -> Retry:
        backoff = ExponentialWithJitterBackoff(self.backoff_cap, self.backoff_base)
        return _NoAuthRetry(backoff, self.retries)


class _NoAuthRetry(Retry):
    """redis-py's AuthenticationError is a ConnectionError, so it would be retried with
    backoff: a wrong password cannot get better by waiting."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        def retryable(exc: Exception) -> bool:
            if isinstance(exc, AuthenticationError):
                return False
            return is_retryable is None or bool(is_retryable(exc))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def _check(url: object, cluster: bool | None) -> tuple[SplitResult, bool]:
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"Redis URL must be a non-empty string, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidURLError(f"malformed Redis URL {redact(url)}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise InvalidURLError(
            f"unsupported scheme in {redact(url)}; use redis://, rediss://, unix:// "
            "or redis+cluster://"
        )
    is_cluster = parts.scheme.endswith("+cluster") or bool(cluster)
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
    return parts, is_cluster


def make_client(url: str, cluster: bool | None = None, options: Options | None = None) -> Client:
    """A redis-py client (standalone or Cluster) for ``url``; bytes in, bytes out."""
    parts, is_cluster = _check(url, cluster)
    opts = options or Options()
    common: dict[str, Any] = {
        "socket_timeout": opts.socket_timeout,
        "socket_connect_timeout": opts.connect_timeout,
        "retry": opts.retry(),
        "client_name": f"kvstate-{os.getpid()}",
    }
    if is_cluster:
        plain = urlunsplit(parts._replace(scheme=parts.scheme.replace("+cluster", "")))
        return RedisCluster.from_url(plain, **common)
    return redis.Redis.from_url(url, health_check_interval=opts.health_check_interval, **common)


def check_url(url: str, cluster: bool | None = None) -> bool:
    """Validate ``url``; returns whether it names a Cluster."""
    return _check(url, cluster)[1]
