"""The Store's lean execution path (kvstate.store.wire) on real Redis: one packed write and
one read loop per round trip, with redis-py's reply shapes for plain commands, NOSCRIPT
reload, error translation, reconnects, and Cluster transactions one trip per node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import CorruptStateError, InvalidArgumentError, KVStateError
from kvstate.store import Store, command_call
from kvstate.testing import RoundTrips
from tests.helpers import PREFILL_ADDR, keys_of, managers, scaled

NAMESPACE = "lean"  # of the ``store`` fixture (tests/conftest.py)


def test_plain_commands_keep_redis_py_reply_shapes(store: Store) -> None:
    k = store.keys.participant(1, "tx", "e")
    c = store._command
    replies = store.execute(
        [
            c("HSET", k, args=["a", 1, "b", b"\x00\xff"]),
            c("PEXPIRE", k, args=[60_000]),
            c("HGETALL", k),
            c("OBJECT IDLETIME", k),
            c("HMGET", k, args=["a", "missing"]),
        ]
    )
    assert replies[0] == 2
    assert replies[1] is True  # redis-py's callback: a bool, as before
    assert replies[2] == {b"a": b"1", b"b": b"\x00\xff"}  # a dict, as before
    assert isinstance(replies[3], int)
    assert replies[4] == [b"1", None]
    store.execute([c("DEL", k)])


def test_errors_are_translated(store: Store) -> None:
    k = store.keys.participant(2, "tx", "e")
    store.execute([command_call("SET", k, args=["x", "PX", 60_000])])
    with pytest.raises(CorruptStateError):
        store.execute([store.poll(2, "tx", "e")])
    with pytest.raises(CorruptStateError):  # the same inside a batch, after a good call
        store.execute([command_call("PTTL", k), store.poll(2, "tx", "e")])
    with pytest.raises(InvalidArgumentError, match="pass text, bytes or numbers"):
        store.execute([command_call("SET", k, args=[object()])])
    with pytest.raises(KVStateError, match="Redis rejected"):
        store.execute([command_call("HGET", k, args=[])])  # wrong arity
    store.execute([command_call("DEL", k)])


def flush_scripts(store: Store) -> None:
    """SCRIPT FLUSH, and FUNCTION FLUSH where the server has it, on every primary."""
    for _, node in store.nodes():
        node.script_flush()
        if int(node.info("server")["redis_version"].split(".")[0]) >= 7:
            node.function_flush()


def test_noscript_reload_and_reconnect(store: Store) -> None:
    """SCRIPT FLUSH, FUNCTION FLUSH and CLIENT KILL between calls: the next calls (a lone
    poll, a batch, a transaction) answer as if nothing happened."""
    p, d = managers(store, lease=60.0)
    with p, d:
        snd = p.sender(3)
        rcv = d.receiver(3, PREFILL_ADDR)
        assert rcv.init([1, 2]) == KVPoll.WaitingForInput
        flush_scripts(store)
        # FCALL -> Function not found -> FUNCTION LOAD + FCALL (EVALSHA -> NOSCRIPT -> EVAL)
        assert snd.poll() == KVPoll.WaitingForInput
        flush_scripts(store)
        for _, node in store.nodes():
            node.client_kill_filter(_type="normal", skipme=True)
        assert p.poll_many([3]) == {3: KVPoll.WaitingForInput}
        assert snd.begin_transfer() == KVPoll.Transferring
        for _, node in store.nodes():
            node.client_kill_filter(_type="normal", skipme=True)
        snd.finish_transfer()
        assert rcv.poll() == KVPoll.Success
        snd.clear()
        rcv.clear()  # a MULTI/EXEC per slot
    assert keys_of(store) == []


@pytest.mark.cluster
def test_cluster_transaction_one_round_trip_per_node(redis_cluster_url: str) -> None:
    store = kvstate.connect(redis_cluster_url, namespace="lean")
    rooms = range(30)  # slots all over the three primaries
    calls = [command_call("HSET", store.keys.room_hash(r), args=["tx:e", 1]) for r in rooms] + [
        command_call("PEXPIRE", store.keys.room_hash(r), args=[60_000]) for r in rooms
    ]
    with RoundTrips.installed() as rt:
        before = rt.count
        replies = store.execute(calls, transaction=True)
        assert rt.count - before == 3
    assert replies == [1] * 30 + [True] * 30
    with RoundTrips.installed() as rt:
        before = rt.count
        store.execute([command_call("DEL", store.keys.room_hash(r)) for r in rooms], True)
        assert rt.count - before == 3
    assert keys_of(store) == []
    store.close()


def test_tls_and_acl_paths_use_the_pool(redis_tls_url: str) -> None:
    """TLS connections come from redis-py's pool: the lean path only packs and reads."""
    store = kvstate.connect(redis_tls_url, namespace="lean")
    p, d = managers(store, lease=60.0)
    with p, d:
        snd = p.sender(1)
        rcv = d.receiver(1, PREFILL_ADDR)
        assert rcv.init([1]) == KVPoll.WaitingForInput
        assert p.poll_many([1]) == {1: KVPoll.WaitingForInput}
        snd.clear()
        rcv.clear()
    store.close()


@pytest.mark.slow
def test_bench_quick_reports_every_figure() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "tools" / "bench_state.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=scaled(600),
        check=True,
        cwd=root,
    )
    res = json.loads(out.stdout)
    for deployment in ("standalone", "cluster3"):
        r = res[deployment]
        for key in (
            "single_lifecycles_per_s",
            "batched_lifecycles_per_s",
            "batched_redis_cmd_us_per_lifecycle",
            "batched_redis_cpu_us_per_lifecycle",
            "script_us_per_call",
            "processes",
        ):
            assert key in r, (deployment, key)
        for n in ("1_rooms", "64_rooms", "256_rooms"):
            step = r["round_trips_per_step"][n]
            nodes = 3 if deployment == "cluster3" else 1
            assert step["poll_many"] <= nodes and step["begin_many"] <= nodes, step
    for deployment in ("standalone", "cluster3"):  # memory per in-flight room
        mem = res[deployment]["room_memory"]
        assert res[deployment]["room_memory_bytes"] == mem["used_memory_bytes_per_room"] > 0
        assert mem["memory_usage_bytes_per_room"] == res[deployment]["room_memory_usage_bytes"]
        assert res[deployment]["room_keys"] == len(set(mem["keys"]) - {"trace"}) == 3
        assert mem["keys_per_room"] >= 3, mem
        assert set(mem["keys"]) - {"trace"} == {"tx", "rx", "room"}, mem["keys"]
    standalone = res["standalone"]
    assert "ping_raw_tcp_per_s" in standalone
    for kind in ("single", "batched"):  # the PING bound sampled in each round
        low, high = standalone[f"{kind}_ratio_to_ping_bound_unix_range"]
        assert 0 < low <= standalone[f"{kind}_ratio_to_ping_bound_unix"] <= high
    assert standalone["ping_rounds"] >= 8
    assert "scale_out_3_vs_1" in res
    for deployment in ("standalone", "cluster3_with_replicas"):  # durable mode's cost
        r = res["durable"][deployment]
        assert r["durable_round_trips_per_lifecycle"] == r["plain_round_trips_per_lifecycle"]
        for key in ("single_durable_vs_plain_median", "durable_redis_cmd_us_per_lifecycle"):
            assert r[key] > 0, (deployment, key)
    for deployment in ("standalone", "cluster3"):  # the room trace's cost: no round trip
        r = res["trace"][deployment]
        trips = 7 if deployment == "standalone" else 10
        assert r["off_round_trips_per_lifecycle"] == trips, r
        assert r["full_round_trips_per_lifecycle"] == r["default_round_trips_per_lifecycle"]
        assert r["full_round_trips_per_lifecycle"] == trips
        assert r["trace_entries_per_room"] == 10 and r["trace_bytes_per_room"] > 0, r
        assert r["full_commands_per_lifecycle"] > r["off_commands_per_lifecycle"], r
