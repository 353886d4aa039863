"""Plain redis-py clients, for launchers, tests and tools that speak to a server directly.

No kvstate deadline, retry policy or error translation: a launcher pings the server it
started with these, and tests and tools set servers up (CONFIG SET, FLUSHALL, CLUSTER
FAILOVER) or look at them. They come from here because only kvstate.store imports
redis-py; code outside it names their types as ``PlainClient`` / ``PlainClusterClient``
and catches ``PLAIN_ERRORS``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

PlainClient: TypeAlias = redis.Redis
PlainClusterClient: TypeAlias = RedisCluster
# What a plain client's commands raise: redis-py's errors, and the socket's.
PLAIN_ERRORS = (redis.RedisError, OSError)


def plain_client(
    *,
    unix_socket: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl: bool = False,
    **kwargs: Any,
) -> PlainClient:
    """A client of one server, on its unix socket when given (else TCP, TLS with
    ``ssl``); ``kwargs`` go to redis-py (password, timeouts, retry...)."""
    if unix_socket is not None:
        return redis.Redis(unix_socket_path=unix_socket, **kwargs)
    if ssl:
        return redis.Redis(host=host, port=port, ssl=True, **kwargs)
    return redis.Redis(host=host, port=port, **kwargs)


def plain_cluster_client(host: str, port: int, **kwargs: Any) -> PlainClusterClient:
    """A Cluster client that finds the nodes through ``host:port``."""
    return RedisCluster(host=host, port=port, **kwargs)


def no_retry() -> Retry:
    """No client-side retries: callers poll in their own loops, with their own deadline."""
    return Retry(NoBackoff(), 0)
