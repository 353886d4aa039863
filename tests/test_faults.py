"""The state layer under faults, on real redis-server processes (no mocks).

- a server restarted mid-run (no persistence: every key is gone);
- ``CLIENT KILL TYPE normal`` storms while lifecycles and clears run;
- ``SCRIPT FLUSH`` storms;
- a server that is down, or frozen (SIGSTOP), must turn into a StateConnectionError
  within a bounded time, naming the redacted URL and what to do.

The figures each test measured are printed (``pytest -s`` shows them) so docs/faults.md
can quote them.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import kvstate
from kvstate import KVPoll
from kvstate.errors import KVStateError, StateConnectionError
from kvstate.ops import reads
from kvstate.roles import STATE_LOST
from kvstate.store import Store, command_call
from kvstate.store.connection import Options
from kvstate.testing import RedisCluster, RedisProcess
from tests.helpers import (
    PREFILL_ADDR,
    assert_every_key_has_ttl,
    keys_of,
    room_keys,
    scaled,
    wait_for,
)

PASSWORD = "Fault-pw/9:x@y"  # needs quoting in a URL: redaction must still hide it


def report(name: str, **figures: object) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def admin_for(proc: RedisProcess) -> redis.Redis:
    """A connection of our own (not kvstate's) for fault injection and statistics."""
    return proc.client(socket_timeout=5.0, retry=Retry(NoBackoff(), 3))


def commandstats(admin: redis.Redis) -> dict[str, int]:
    """Executed calls per command name (``INFO commandstats``)."""
    raw = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}


def errorstats(admin: redis.Redis) -> dict[str, int]:
    raw = admin.info("errorstats")
    return {k.removeprefix("errorstat_"): int(v["count"]) for k, v in raw.items()}


@contextmanager
def background(action: Callable[[], int], pause: tuple[float, float]) -> Iterator[list[int]]:
    """Run ``action`` in a thread every ``pause`` seconds (uniform range) until the
    block ends; yields [times run, sum of what action returned]."""
    stop = threading.Event()
    tally = [0, 0]
    errors: list[BaseException] = []

    def loop() -> None:
        rng = random.Random(1)
        while not stop.wait(rng.uniform(*pause)):
            try:
                tally[1] += action()
                tally[0] += 1
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)
                return

    thread = threading.Thread(target=loop, name="fault-injector", daemon=True)
    thread.start()
    try:
        yield tally
    finally:
        stop.set()
        thread.join(scaled(10))
    assert not errors, f"fault injector failed: {errors[0]!r}"


def three_managers(store: Store, **kw: Any) -> tuple[kvstate.KVManager, ...]:
    """Two prefill engines at one bootstrap address, one decode engine."""
    p1 = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, **kw)
    p2 = kvstate.KVManager(store, "prefill", "prefill-a.tp1", PREFILL_ADDR, **kw)
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998", **kw)
    return p1, p2, d


def two_sender_room(
    store: Store,
    p1: kvstate.KVManager,
    p2: kvstate.KVManager,
    d: kvstate.KVManager,
    room: int,
    variant: int,
    made: list[Any] | None = None,
) -> None:
    """One room whose receiver needs both senders; ``variant`` picks the ending:
    0 both senders finish (the receiver must see Success: no lost ack),
    1 the receiver clears early, then the senders finish (nothing may come back),
    2 a sender aborts mid-transfer (every participant Failed, one reason)."""
    s1, s2 = p1.sender(room), p2.sender(room)
    rcv = d.receiver(room, PREFILL_ADDR)
    if made is not None:
        made += [s1, s2, rcv]
    assert rcv.init(np.arange(room % 50, room % 50 + 16)) == KVPoll.WaitingForInput
    assert s1.poll() == KVPoll.WaitingForInput
    assert s2.poll() == KVPoll.WaitingForInput
    assert s1.begin_transfer() == KVPoll.Transferring
    if variant == 1:
        rcv.clear()  # gave up: neither sender may reach Success (one outcome per room)
        assert s1.finish_transfer() == KVPoll.Failed and "gone" in s1.reason
        assert s2.begin_transfer() == KVPoll.Failed
        gone = store.execute(
            [
                command_call("EXISTS", store.keys.participant(room, "rx", d.engine)),
                reads.acks_of(store.keys, room, d.engine),
            ]
        )
        assert gone == [0, []], f"room {room}: the cleared receiver or its acks came back"
    elif variant == 2:
        s2.abort("storm abort")
        for part in (s1, s2, rcv):
            assert part.poll() == KVPoll.Failed
            assert part.reason.count("storm abort") == 1, part.reason
    else:
        assert s1.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.WaitingForInput  # one ack of the two it needs
        assert s2.begin_transfer() == KVPoll.Transferring
        assert s2.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success, f"room {room}: receiver lost an ack"
        acks = store.execute([reads.acks_of(store.keys, room, d.engine)])[0]
        assert acks == sorted([p1.engine, p2.engine])
    for part in (s1, rcv, s2):
        part.clear()
    left = room_keys(store, room)
    assert left == [], f"room {room} (variant {variant}) resurrected after clear: {left}"


# --------------------------------------------------------------------------- restart


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_restart_loses_state_clients_recover(redis_server_factory, transport: str) -> None:
    """redis-server restarted with no persistence: every room reads Failed 'state lost'
    (no KeyError, no hang), clear() works, the heartbeat registers the engines again,
    and new rooms run end to end, all over the same clients."""
    proc = redis_server_factory(port="auto")
    url = proc.unix_url if transport == "unix" else proc.tcp_url
    store = kvstate.connect(url, namespace="restart")
    p1, p2, d = three_managers(store, lease=1.0, heartbeat_interval=0.1)
    with p1, p2, d:
        # Rooms at every stage, the receivers needing both senders.
        parts: dict[int, list[Any]] = {}
        for room, stage in enumerate(["boot", "wait", "xfer", "half", "done", "failed"]):
            s1, s2 = p1.sender(room), p2.sender(room)
            rcv = d.receiver(room, PREFILL_ADDR)
            parts[room] = [s1, s2, rcv]
            for part in (s1, s2, rcv):
                part.poll()  # participants are created with their first operation
            if stage == "boot":
                continue
            rcv.init([1, 2, 3])
            if stage == "wait":
                continue
            s1.begin_transfer()
            if stage in ("half", "done"):
                s1.finish_transfer()
            if stage == "done":
                s2.begin_transfer()
                s2.finish_transfer()
                assert rcv.poll() == KVPoll.Success
            if stage == "failed":
                s2.abort("before the restart")
        assert all(store.client.exists(store.keys.participant(r, "tx", p1.engine)) for r in parts)

        t0 = time.monotonic()
        proc.restart()
        restart_s = time.monotonic() - t0
        assert keys_of(store) == [] or all(":engine" in k for k in keys_of(store))

        # The first call after the restart reconnects by itself and finds nothing.
        t0 = time.monotonic()
        first = parts[2][0].poll()
        first_call_s = time.monotonic() - t0
        assert first == KVPoll.Failed and STATE_LOST in parts[2][0].reason
        for room, trio in parts.items():
            for part in trio:
                assert part.poll() == KVPoll.Failed, (room, part)
                assert "state lost" in part.reason
        assert set(d.poll_many(list(parts)).values()) == {KVPoll.Failed}
        assert set(p2.poll_many(list(parts)).values()) == {KVPoll.Failed}
        # Transitions on vanished participants change nothing (no resurrection).
        s1, s2, rcv = parts[1]
        assert rcv.init([4, 5]) == KVPoll.Failed
        assert s1.begin_transfer() == KVPoll.Failed
        assert s2.finish_transfer() == KVPoll.Failed
        assert s1.fail("too late") == KVPoll.Failed
        parts[3][1].abort("after the restart")  # leaves only the abort mark (with a TTL),
        for room in parts:  # for a side that joins later; the clears below take it
            left = [k for k in room_keys(store, room) if k != store.keys.aborted(room)]
            assert left == [], f"room {room} came back"
        # failure_exception() carries the reason and clears; clear() of the rest is quiet.
        err = parts[4][2].failure_exception()
        assert "state lost" in err.reason and err.room == 4
        for trio in parts.values():
            for part in trio:
                part.clear()
                part.clear()
        assert [k for k in keys_of(store) if ":engine" not in k] == []

        # Heartbeats notice the lapsed lease (renew finds no key) and register again.
        t0 = time.monotonic()
        assert wait_for(
            lambda: all(
                (info := p.registry.get(p.engine)) is not None and info.incarnation == p.incarnation
                for p in (p1, p2, d)
            ),
            timeout=5.0,
            step=0.01,
        ), "an engine did not register again after the restart"
        reregister_s = time.monotonic() - t0
        assert all(m.heartbeat.running for m in (p1, p2, d))

        # New rooms run end to end on the same clients.
        for room in range(100, 110):
            two_sender_room(store, p1, p2, d, room, variant=room % 3)
        assert_every_key_has_ttl(store)
    assert keys_of(store) == []
    store.close()
    report(
        "restart",
        transport=transport,
        restart_s=f"{restart_s:.3f}",
        first_call_after_restart_s=f"{first_call_s:.4f}",
        reregistered_within_s=f"{reregister_s:.3f}",
    )


# --------------------------------------------------------------------------- CLIENT KILL


def _primaries(target: RedisProcess | RedisCluster) -> list[redis.Redis]:
    if isinstance(target, RedisCluster):
        return [target.node_client(n) for n in target.primaries()]
    return [admin_for(target)]


def _sum_stats(nodes: list[redis.Redis]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in nodes:
        for name, calls in commandstats(c).items():
            total[name] = total.get(name, 0) + calls
    return total


@pytest.mark.slow
@pytest.mark.parametrize(
    "deployment", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)]
)
def test_client_kill_storm_no_double_effect(
    request: pytest.FixtureRequest, redis_server_factory, deployment: str
) -> None:
    """A thread runs CLIENT KILL TYPE normal (on every primary) every few ms while
    two-sender rooms run through create, publish, transfer, finish, abort and clear.
    The clients re-send what a kill cut off, sometimes a script or MULTI/EXEC the server
    had already run (counted from INFO commandstats against a run without kills): no
    double effect, no resurrected key after clear, no key without TTL, no lost ack.

    A call may still fail, as StateConnectionError only: redis-py checks a pooled
    connection out (reconnect, then can_read()) outside its retry loop, so a kill landing
    right after a reconnect escapes every retry. Such rooms are cleared afterwards and
    must leave nothing."""
    if deployment == "standalone":
        proc = redis_server_factory(port="auto")
        url = proc.unix_url
        nodes = _primaries(proc)
        pause = (0.003, 0.01)
    else:
        url = request.getfixturevalue("redis_cluster_url")
        nodes = _primaries(request.getfixturevalue("redis_cluster"))
        pause = (0.01, 0.03)  # per node: 3 nodes get one kill each per pause
    # Small backoff so a storm of kills does not turn into a storm of sleeps, and more
    # retries than the default 5: a reconnect takes ~4 round trips (connect, CLIENT
    # SETNAME, SETINFO x2), so a kill every few ms cuts a good share of them.
    opts = Options(retries=10, backoff_base=0.002, backoff_cap=0.02)
    store = kvstate.connect(url, namespace="kill", options=opts)
    # the leases are not what this scenario tests: a starved heartbeat must not lapse them
    p1, p2, d = three_managers(store, lease=scaled(2.0), heartbeat_interval=0.05)
    rooms = 240 if deployment == "standalone" else 120
    failed: list[tuple[int, str]] = []
    made: list[Any] = []
    with p1, p2, d:
        # Baseline: the same workload without kills, to count the scripts and
        # transactions it makes the server run.
        for c in nodes:
            c.config_resetstat()
        for room in range(rooms):
            two_sender_room(store, p1, p2, d, 10_000 + room, variant=room % 3)
        base = _sum_stats(nodes)

        for c in nodes:
            c.config_resetstat()
        conns = sum(int(c.info("stats")["total_connections_received"]) for c in nodes)
        t0 = time.monotonic()
        with background(
            lambda: sum(int(c.client_kill_filter(_type="normal")) for c in nodes), pause=pause
        ) as kills:
            room = 0  # at least `rooms` rooms, and on until the storm was strong enough
            while room < rooms or (min(kills) <= 100 and time.monotonic() - t0 < 30):
                try:
                    two_sender_room(store, p1, p2, d, room, room % 3, made)
                except StateConnectionError as exc:
                    failed.append((room, str(exc)))
                room += 1
        storm_s, rooms = time.monotonic() - t0, room
        stats = _sum_stats(nodes)
        reconnects = sum(int(c.info("stats")["total_connections_received"]) for c in nodes) - conns
        assert kills[0] > 100 and kills[1] > 100, f"the storm was too weak: {kills}"
        assert reconnects > 50, "kills did not cut kvstate's connections"
        assert len(failed) <= rooms // 15, f"{len(failed)} rooms failed: {failed[:3]}"
        for part in made:  # what the failed rooms left behind (a no-op for the others)
            part.clear()
        assert keys_of(store, store.keys.prefix + "{*") == []
        assert_every_key_has_ttl(store)
        assert all(m.heartbeat.running for m in (p1, p2, d)), "a heartbeat thread died"
        for m in (p1, p2, d):  # every engine still holds its own lease
            info = m.registry.get(m.engine)
            assert info is not None and info.incarnation == m.incarnation
    assert keys_of(store) == []
    store.close()
    for c in nodes:
        c.close()
    report(
        "client-kill",
        deployment=deployment,
        rooms=rooms,
        storm_s=f"{storm_s:.2f}",
        kill_commands=kills[0],
        connections_killed=kills[1],
        reconnects=reconnects,
        rooms_failed_cleanly=len(failed),
        evalsha_baseline=base.get("evalsha", 0),
        evalsha_storm=stats.get("evalsha", 0),
        exec_baseline=base.get("exec", 0),
        exec_storm=stats.get("exec", 0),
    )


@pytest.mark.parametrize(
    "deployment", ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)]
)
def test_script_flush_storm_is_transparent(request: pytest.FixtureRequest, deployment: str) -> None:
    """SCRIPT FLUSH and FUNCTION FLUSH every 2-8 ms on every primary while rooms run: the
    store reloads the scripts after NOSCRIPT (EVAL path) or the library after "Function
    not found" (FCALL path, Redis >= 7) and every operation still succeeds."""
    if deployment == "standalone":
        url = request.getfixturevalue("redis_url")
        target: RedisProcess | RedisCluster = request.getfixturevalue("redis_proc")
    else:
        url = request.getfixturevalue("redis_cluster_url")
        target = request.getfixturevalue("redis_cluster")
    store = kvstate.connect(url, namespace="flush")
    p1, p2, d = three_managers(store, lease=2.0)
    rooms = 150
    nodes = _primaries(target)

    functions = all(int(c.info("server")["redis_version"].split(".")[0]) >= 7 for c in nodes)

    def flush() -> int:
        for c in nodes:
            c.script_flush()
            if functions:
                c.function_flush()
        return len(nodes)

    def missing() -> int:  # NOSCRIPT, and FCALLs that met "Function not found"
        fcall = [c.info("commandstats").get("cmdstat_fcall", {}) for c in nodes]
        return sum(errorstats(c).get("NOSCRIPT", 0) for c in nodes) + sum(
            int(f.get("failed_calls", 0)) for f in fcall
        )

    noscript_before = missing()
    with p1, p2, d:
        t0 = time.monotonic()
        with background(flush, pause=(0.002, 0.008)) as flushes:
            for room in range(rooms):
                two_sender_room(store, p1, p2, d, room, variant=room % 3)
                if room % 10 == 0:  # the batched path too: one pipeline of many scripts
                    assert set(d.poll_many(range(room, room + 20)).values()) == {KVPoll.Failed}
        took = time.monotonic() - t0
        assert flushes[0] > 20, f"too few flushes to mean anything: {flushes}"
        noscript = missing() - noscript_before
        assert noscript > 0, "no call met a flush: the test did not test the reload"
        assert_every_key_has_ttl(store)
    assert keys_of(store) == []
    store.close()
    for c in nodes:
        c.close()
    report(
        "script-flush",
        deployment=deployment,
        rooms=rooms,
        flushes=flushes[0],
        noscript_replies=noscript,
        seconds=f"{took:.2f}",
    )


# --------------------------------------------------------------------------- Redis down


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_redis_down_raises_bounded_and_recovers(redis_server_factory, transport: str) -> None:
    """Redis killed: every kind of call raises StateConnectionError within a bounded
    time, with the redacted URL and what to do; after a restart the same objects work."""
    proc = redis_server_factory(port="auto", password=PASSWORD)
    url = proc.unix_url if transport == "unix" else proc.tcp_url
    store = kvstate.connect(url, namespace="down")
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=1.0, heartbeat_interval=0.1)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=1.0, heartbeat_interval=0.1)
    snd = p.sender(1)
    rcv = d.receiver(1, PREFILL_ADDR)
    rcv.init([1, 2])
    assert snd.poll() == KVPoll.WaitingForInput

    proc.kill()
    ops: dict[str, Callable[[], object]] = {
        "poll": snd.poll,
        "begin_transfer": snd.begin_transfer,
        "poll_many": lambda: d.poll_many([1, 2, 3]),
        "abort": lambda: rcv.abort("x"),
        "clear": snd.clear,
        "new receiver": lambda: d.receiver(2, "10.0.0.9:1").poll(),
        "connect": lambda: kvstate.connect(url, namespace="down"),
        "KVManager": lambda: kvstate.KVManager(store, "prefill", "p9"),
        "scan": lambda: list(store.scan(store.keys.all_pattern)),
    }
    took: dict[str, float] = {}
    texts: dict[str, str] = {}

    def attempt(name: str, op: Callable[[], object]) -> None:
        t0 = time.monotonic()
        try:
            op()
        except StateConnectionError as exc:
            texts[name] = str(exc)
        took[name] = time.monotonic() - t0

    # All at once, each in its own thread: the figures are per call, the wall time is one.
    threads = [threading.Thread(target=attempt, args=item) for item in ops.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(30))
    for name in ops:
        assert name in texts, f"{name} did not raise StateConnectionError"
        text = texts[name]
        assert store.url in text, text  # the redacted URL
        assert "***" in text and PASSWORD not in text and "Fault-pw" not in text
        assert "is redis-server running" in text and "KVSTATE_REDIS_URL" in text
        assert took[name] < scaled(5.0), f"{name} took {took[name]:.1f} s to give up"
    assert snd.status == KVPoll.WaitingForInput  # a failed call does not invent a status

    proc.restart()  # empty, same address, same password
    assert snd.poll() == KVPoll.Failed and "state lost" in snd.reason
    snd.clear()
    rcv.clear()
    assert wait_for(lambda: p.registry.get("p0") is not None, 5.0)
    t0 = time.monotonic()
    p.close()
    d.close()
    close_s = time.monotonic() - t0
    assert keys_of(store) == []
    store.close()
    report(
        "redis-down",
        transport=transport,
        **{k.replace(" ", "_") + "_s": f"{v:.3f}" for k, v in took.items()},
        close_s=f"{close_s:.3f}",
    )


def test_frozen_redis_times_out_bounded(redis_server_factory) -> None:
    """A server that accepts connections but never answers (SIGSTOP): calls raise
    StateConnectionError after about (retries + 1) x socket_timeout, never hang; after
    SIGCONT the same store works again."""
    proc = redis_server_factory(port="auto")
    opts = Options(socket_timeout=0.3, connect_timeout=0.3, retries=2, backoff_cap=0.05)
    store = kvstate.connect(proc.tcp_url, namespace="frozen", options=opts)
    p = kvstate.KVManager(store, "prefill", "p0", lease=5.0)
    snd = p.sender(1)
    assert snd.poll() == KVPoll.Bootstrapping
    pid = proc.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(StateConnectionError) as info:
            snd.poll()
        frozen_s = time.monotonic() - t0
        bound = (opts.retries + 1) * (opts.socket_timeout + opts.backoff_cap) + scaled(0.5)
        assert frozen_s < bound, (frozen_s, bound)
        assert "Timeout" in str(info.value) or "timed out" in str(info.value)
        assert store.url in str(info.value)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert snd.poll() == KVPoll.Bootstrapping  # nothing was lost: the server only paused
    snd.clear()
    p.close()
    assert keys_of(store) == []
    store.close()
    default = Options()
    worst = (default.retries + 1) * default.socket_timeout
    report(
        "frozen",
        gave_up_after_s=f"{frozen_s:.2f}",
        bound_s=f"{bound:.2f}",
        default_options_worst_case_s=f"{worst:.0f}+backoff",
    )


def test_cluster_url_down_raises_state_connection_error() -> None:
    """A Cluster client asks its URL's node for the slot map when it is made: with that
    node down, connect() raises StateConnectionError (not redis-py's
    RedisClusterException), redacted and bounded."""
    from urllib.parse import quote

    from kvstate.testing import free_port

    url = f"redis+cluster://:{quote(PASSWORD, safe='')}@127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StateConnectionError) as info:
        kvstate.connect(url, namespace="down")
    took = time.monotonic() - t0
    text = str(info.value)
    assert "Redis Cluster" in text and "***" in text and "Fault-pw" not in text
    assert took < scaled(5.0)
    report("cluster-down", connect_refused_after_s=f"{took:.2f}")


def test_url_pointing_at_a_replica(redis_server_factory) -> None:
    """A standalone URL that names a replica (a failover demoted it, or a typo): every
    write path, scripts and MULTI/EXEC alike, raises StateConnectionError that says so,
    never redis-py's ReadOnlyError; reads still work."""
    primary = redis_server_factory(port="auto")
    replica = redis_server_factory(port="auto")
    with replica.client() as c:
        c.replicaof("127.0.0.1", primary.port)
    store = kvstate.connect(replica.tcp_url, namespace="ro")
    writes: dict[str, Callable[[], object]] = {
        "register (MULTI/EXEC)": lambda: kvstate.KVManager(store, "prefill", "p0"),
        "create (script)": lambda: store.execute([store.create(1, "tx", "p0", {"peers": 1})]),
        "batch (pipeline)": lambda: store.execute(
            [store.create(1, "tx", "p0", {"peers": 1}), store.poll(1, "tx", "p0")]
        ),
        "clear (MULTI/EXEC)": lambda: store.clear(1, "tx", "p0"),
    }
    for name, write in writes.items():
        with pytest.raises(StateConnectionError) as info:
            write()
        assert "read-only replica" in str(info.value) and store.url in str(info.value), name
    assert store.execute([store.poll(1, "tx", "p0")])[0].status is None  # reads answer
    store.close()


def test_redis_out_of_memory(redis_server_factory, caplog: pytest.LogCaptureFixture) -> None:
    """Redis over maxmemory (noeviction) refuses writes: engines get KVStateError saying
    so (never a raw redis-py error), the heartbeat survives its refused re-registration,
    nothing is half-written (every key keeps its TTL), and all recovers with memory."""
    proc = redis_server_factory(port="auto")
    admin = admin_for(proc)
    store = kvstate.connect(proc.unix_url, namespace="oom")
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=0.3, heartbeat_interval=0.05)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=5.0)
    snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
    rcv.init([1, 2])
    assert snd.poll() == KVPoll.WaitingForInput
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")  # every write that needs memory is refused
    try:
        admin.delete(store.keys.engine("p0"))  # p0's lease lapses: it must register again
        outcomes: dict[str, str] = {}
        ops: dict[str, Callable[[], object]] = {
            "register": lambda: kvstate.KVManager(store, "prefill", "p1"),
            "new room": lambda: p.sender(2).poll(),
            "publish": lambda: d.receiver(3, PREFILL_ADDR).init([1]),
            "transition": snd.begin_transfer,
            "poll": snd.poll,
        }
        for name, op in ops.items():
            try:
                op()
                outcomes[name] = "ok"
            except KVStateError as exc:
                outcomes[name] = "refused"
                assert "out of memory" in str(exc) and "maxmemory" in str(exc), str(exc)
        assert outcomes["register"] == outcomes["new room"] == "refused", outcomes
        assert outcomes["poll"] == "ok", outcomes
        assert wait_for(
            lambda: any(
                "out of memory" in r.getMessage()
                for r in caplog.records
                if r.name == "kvstate.roles.lease"
            ),
            5.0,
        )
        assert p.heartbeat.running, "the heartbeat died on a refused registration"
        assert_every_key_has_ttl(store)
    finally:
        admin.config_set("maxmemory", "0")
    assert wait_for(lambda: p.registry.get("p0") is not None, 5.0)
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    assert rcv.poll() == KVPoll.Success
    for m in (p, d):
        m.clear_many(m.live_rooms)
        m.close()
    assert keys_of(store) == []
    store.close()
    admin.close()
    report("out-of-memory", **{k.replace(" ", "_"): v for k, v in outcomes.items()})
