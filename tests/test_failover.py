"""Redis Cluster failover under load: a primary holding busy rooms hands over to its
replica (CLUSTER FAILOVER) while engines run lifecycles against it.

What must hold: every room completes or fails cleanly (Failed with a reason); no
call raises anything but StateConnectionError (and, with a coordinated failover,
none at all); the store's Cluster path follows the new topology after MOVED; clears
made after the failover leave nothing, and every key keeps its TTL.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import StateConnectionError
from kvstate.store import Store
from kvstate.testing import RedisCluster, RedisProcess
from tests.helpers import PREFILL_ADDR, assert_every_key_has_ttl, keys_of, scaled, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def cluster(redis_cluster_replicas: RedisCluster) -> RedisCluster:
    redis_cluster_replicas.flushall()
    return redis_cluster_replicas


NAMESPACE = "fo"  # of the ``store`` fixture (tests/conftest.py)


@pytest.fixture
def store_url(cluster: RedisCluster) -> str:
    """``store`` on the Cluster with replicas (failovers)."""
    return cluster.url


def port_of_room(store: Store, room: int) -> int:
    """Port of the primary that the store's client believes holds ``room``'s slot."""
    key = store.keys.participant(room, "tx", "x")
    return int(store.client.get_node_from_key(key).port)  # type: ignore[union-attr]


def rooms_on(store: Store, port: int, count: int, start: int = 0) -> list[int]:
    out: list[int] = []
    room = start
    while len(out) < count:
        if port_of_room(store, room) == port:
            out.append(room)
        room += 1
    return out


def errorstats(node: RedisProcess) -> dict[str, int]:
    with node.client() as c:
        raw = c.info("errorstats")
    return {k.removeprefix("errorstat_"): int(v["count"]) for k, v in raw.items()}


def all_keys(cluster: RedisCluster, pattern: str) -> list[str]:
    """Keys on every live primary, asked directly (not through the store's topology);
    room traces left out: they outlive clear() on purpose, each with a TTL (checked)."""
    keys: list[str] = []
    for node in cluster.primaries():
        with cluster.node_client(node) as c:
            for raw in c.scan_iter(match=pattern, count=1000):
                if raw.endswith(b"}:trace"):
                    assert c.pttl(raw) > 0, raw
                else:
                    keys.append(raw.decode())
    return sorted(keys)


class Outcomes:
    """What each room ended as, collected from several worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_room: dict[int, str] = {}
        self.finished_at: dict[int, float] = {}
        self.errors: list[tuple[int, BaseException]] = []
        self.latencies: list[tuple[float, float]] = []  # (start, seconds) per call
        self.made: list[Any] = []

    def timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.latencies.append((t0, time.monotonic() - t0))


def lifecycle(out: Outcomes, p: kvstate.KVManager, d: kvstate.KVManager, room: int) -> None:
    """Create, publish, transfer, finish, clear; records Success or 'Failed: reason'."""
    snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
    with out.lock:
        out.made += [snd, rcv]
    try:
        t = out.timed
        t(rcv.init, np.arange(8))
        t(snd.poll)
        t(snd.begin_transfer)
        t(snd.finish_transfer)
        status = t(rcv.poll)
        if status == KVPoll.Success:
            result = "Success"
        else:
            assert status == KVPoll.Failed, f"room {room} stuck in {status.name}"
            assert rcv.reason, f"room {room} Failed without a reason"
            result = f"Failed: {rcv.reason}"
        t(snd.clear)
        t(rcv.clear)
    except StateConnectionError as exc:
        with out.lock:
            out.errors.append((room, exc))
        return
    with out.lock:
        out.by_room[room] = result
        out.finished_at[room] = time.monotonic()


def _replicated(cluster: RedisCluster, primary: RedisProcess) -> bool:
    """Whether every replica of ``primary`` has applied all of its writes."""
    with primary.client() as c:
        done = int(c.info("replication")["master_repl_offset"])
    for replica in cluster.replicas_of(primary):
        with replica.client() as c:
            if int(c.info("replication").get("slave_repl_offset", -1)) < done:
                return False
    return True


def test_failover_of_busy_primary(cluster: RedisCluster, store: Store) -> None:
    """Four threads run lifecycles on rooms of one primary (and a few elsewhere) while
    that primary fails over to its replica; rooms made before the failover finish and
    clear after it."""
    target: RedisProcess = cluster.primaries()[0]
    busy = rooms_on(store, target.port, 3000)
    elsewhere = [r for r in range(400) if port_of_room(store, r) != target.port][:40]
    p = kvstate.KVManager(
        store, "prefill", "prefill-a.tp0", PREFILL_ADDR, lease=3.0, heartbeat_interval=0.1
    )
    d = kvstate.KVManager(
        store, "decode", "decode-b.tp0", "10.0.0.2:8998", lease=3.0, heartbeat_interval=0.1
    )
    out = Outcomes()
    with p, d:
        # Rooms caught mid-way by the failover: both sides created, receiver published.
        before = [(p.sender(r), d.receiver(r, PREFILL_ADDR)) for r in busy[:20]]
        for snd, rcv in before:
            rcv.init([1, 2, 3])
            assert snd.poll() == KVPoll.WaitingForInput

        stop = threading.Event()
        queue = iter(busy[20:] + elsewhere)
        qlock = threading.Lock()

        def worker() -> None:
            while not stop.is_set():
                with qlock:
                    room = next(queue, None)
                if room is None:
                    return
                try:
                    lifecycle(out, p, d, room)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    with out.lock:
                        out.errors.append((room, exc))

        workers = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
        for w in workers:
            w.start()
        assert wait_for(lambda: len(out.by_room) >= 10, 30.0), "no lifecycle finished"
        done_before = len(out.by_room)
        moved_before = errorstats(target).get("MOVED", 0)
        t0 = time.monotonic()
        new_primary = cluster.failover(target)
        failover_s = time.monotonic() - t0
        # and keep them busy on the new primary for a while
        done_at_failover = len(out.by_room)
        wait_for(lambda: len(out.by_room) >= done_at_failover + 20 or bool(out.errors), 30.0)
        stop.set()
        for w in workers:
            w.join(scaled(60))
        assert not any(w.is_alive() for w in workers), "a worker hung"
        done_after = sum(
            1 for r, at in out.finished_at.items() if at > t0 + failover_s and r in set(busy)
        )
        assert done_before > 0 and done_after > 0, "no load around the failover"
        moved = errorstats(target).get("MOVED", 0) - moved_before
        assert moved > 0, "no call was redirected: the failover did not meet the load"

        # Only clean failures: StateConnectionError (ideally none), or Failed with a reason.
        unexpected = [(r, e) for r, e in out.errors if not isinstance(e, StateConnectionError)]
        assert not unexpected, f"rooms raised {unexpected[:3]}"
        failed = {r: v for r, v in out.by_room.items() if v != "Success"}
        # The store follows the new topology (its slot cache was refreshed on MOVED).
        assert port_of_room(store, busy[0]) == new_primary.port

        # The rooms that straddled the failover finish on the new primary and clear.
        for snd, rcv in before:
            assert snd.begin_transfer() in (KVPoll.Transferring, KVPoll.Failed)
            snd.finish_transfer()
            assert rcv.poll() in (KVPoll.Success, KVPoll.Failed)
            if rcv.status == KVPoll.Failed:
                assert rcv.reason
            snd.clear()
            rcv.clear()
        for part in out.made:  # what rooms that raised left behind
            part.clear()
        # The promoted replica had the function library by replication: the store,
        # meeting a new node, checks its code (its first batches there by EVAL, behind
        # FUNCTION LIST WITHCODE: one per thread that met it first), then runs the
        # scripts there by FCALL (never EVALSHA)
        if cluster.version >= (7, 0, 0):
            with new_primary.client() as c:
                stats = c.info("commandstats")
            fcalls = stats.get("cmdstat_fcall", {}).get("calls", 0)
            evals = stats.get("cmdstat_eval", {}).get("calls", 0)
            assert fcalls > 0 and "cmdstat_evalsha" not in stats, stats
            assert evals < fcalls, stats
        assert all_keys(cluster, store.keys.prefix + "{*") == []
        assert_every_key_has_ttl(store)
        assert p.heartbeat.running and d.heartbeat.running
        for m in (p, d):  # leases held across the failover
            info = m.registry.get(m.engine)
            assert info is not None and info.incarnation == m.incarnation
    assert all_keys(cluster, store.keys.all_pattern) == []
    assert keys_of(store) == []

    window = [s for t, s in out.latencies if t0 - 0.5 <= t <= t0 + failover_s + 0.5]
    print(
        f"\n[failover] failover_s={failover_s:.2f}, rooms={len(out.by_room)}, "
        f"rooms_done_before={done_before}, busy_rooms_done_after={done_after}, "
        f"moved_replies={moved}, failed_cleanly={len(failed)}, "
        f"state_connection_errors={len(out.errors)}, calls_in_window={len(window)}, "
        f"max_call_latency_in_window_s={max(window, default=0):.3f}, "
        f"calls_over_100ms={sum(1 for s in window if s > 0.1)}"
    )


def test_primary_killed_replica_takes_over(tmp_path) -> None:
    """SIGKILL of the primary named in the URL: its replica is promoted after the
    cluster node timeout. Meanwhile calls on its slots raise StateConnectionError within
    a bounded time (never hang, never a raw redis-py error); the store reaches the new
    primary by itself (topology refresh on connection errors); rooms resume or read
    Failed 'state lost', and clearing them leaves nothing. A new connect() through the
    dead node's URL is refused with a clear message: list several nodes in production."""
    cluster = RedisCluster(3, 1, tmp_path / "c").start()
    try:
        store = kvstate.connect(cluster.url, namespace="kill")
        target = cluster.nodes[0]  # the node in the URL
        assert cluster.role(target) == "master" and str(target.port) in cluster.url
        busy = rooms_on(store, target.port, 30)
        other = [r for r in range(200) if port_of_room(store, r) != target.port][:10]
        p = kvstate.KVManager(
            store, "prefill", "p0", PREFILL_ADDR, lease=10.0, heartbeat_interval=0.2
        )
        d = kvstate.KVManager(
            store, "decode", "d0", "10.0.0.2:8998", lease=10.0, heartbeat_interval=0.2
        )
        with p, d:
            rooms = {r: (p.sender(r), d.receiver(r, PREFILL_ADDR)) for r in busy + other}
            for snd, rcv in rooms.values():
                rcv.init([1, 2, 3])
                assert snd.poll() == KVPoll.WaitingForInput
            # replication is asynchronous: wait until the replica has every write
            assert wait_for(lambda: _replicated(cluster, target), 10.0)

            t0 = time.monotonic()
            target.kill()
            # Rooms on the other primaries do not notice.
            for r in other:
                assert rooms[r][0].begin_transfer() == KVPoll.Transferring
            # Rooms on the dead primary: clean errors until the replica takes over.
            snd, rcv = rooms[busy[0]]
            errors, slowest = 0, 0.0
            while True:
                c0 = time.monotonic()
                try:
                    status = snd.begin_transfer()
                    break
                except StateConnectionError as exc:
                    errors += 1
                    assert "Redis" in str(exc) and store.url in str(exc)
                finally:
                    slowest = max(slowest, time.monotonic() - c0)
                assert time.monotonic() - t0 < scaled(30), "the replica never took over"
            recovered_s = time.monotonic() - t0
            assert status in (KVPoll.Transferring, KVPoll.Failed)
            assert slowest < scaled(10.0), f"one call took {slowest:.1f} s"

            # A new client through the dead node's URL cannot even start.
            c0 = time.monotonic()
            with pytest.raises(StateConnectionError) as info:
                kvstate.connect(cluster.url, namespace="kill")
            refused_s = time.monotonic() - c0
            assert str(target.port) in str(info.value)

            results: dict[str, int] = {}
            for snd, rcv in rooms.values():
                snd.begin_transfer()
                snd.finish_transfer()
                st = rcv.poll()
                key = st.name if st != KVPoll.Failed else f"Failed: {rcv.reason[:10]}"
                results[key] = results.get(key, 0) + 1
                assert st in (KVPoll.Success, KVPoll.Failed)
                if st == KVPoll.Failed:
                    assert "state lost" in rcv.reason
                snd.clear()
                rcv.clear()
            assert all_keys(cluster, store.keys.prefix + "{*") == []
            assert_every_key_has_ttl(store)
            assert p.heartbeat.running and d.heartbeat.running
        assert all_keys(cluster, store.keys.all_pattern) == []
        store.close()
    finally:
        cluster.stop()
    print(
        f"\n[primary-killed] recovered_after_s={recovered_s:.2f}, "
        f"state_connection_errors={errors}, slowest_call_s={slowest:.2f}, "
        f"new_connect_refused_after_s={refused_s:.2f}, rooms={results}"
    )
