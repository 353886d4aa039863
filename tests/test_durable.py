"""Durable mode (``Options(durable=True)`` / ``?durable=true``): a sender's Success and an
abort are acknowledged only once a replica confirmed them, with ``WAIT`` in the same
round trip as the script; unconfirmed within the call's time, the call raises
DurabilityError (a StateConnectionError) instead of answering.

Against real servers: a primary with a replica (standalone), the replica stopped, no
replica at all, an ACL without WAIT; and a 3-primary + 3-replica Cluster whose primary
is SIGKILLed, once after its replica was cut off (without durable mode the acknowledged
Success is lost, with it the call refused to acknowledge) and once under load (no
acknowledged Success or abort lost).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvstate
from kvstate import KVPoll, Options
from kvstate.errors import DurabilityError, StateConnectionError
from kvstate.store import Store, wire
from kvstate.testing import RedisCluster, RedisProcess
from tests.helpers import (
    PREFILL_ADDR,
    assert_every_key_has_ttl,
    engine_acl,
    keys_of,
    managers,
    scaled,
    setuser,
    user_url,
    wait_for,
)

DURABLE = Options(durable=True)


def replicated(primary: RedisProcess, replicas: list[RedisProcess]) -> bool:
    """Whether every replica is online and has applied all of the primary's writes."""
    with primary.client() as c:
        info = c.info("replication")
    done = int(info["master_repl_offset"])
    online = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
    if sum(1 for v in online if v.get("state") == "online") < len(replicas):
        return False
    for replica in replicas:
        with replica.client() as c:
            if int(c.info("replication").get("slave_repl_offset", -1)) < done:
                return False
    return True


@pytest.fixture
def primary_replica(
    redis_server_factory: Callable[..., RedisProcess],
) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    primary = redis_server_factory(port="auto", extra_args=["--repl-diskless-sync-delay", "0"])
    replica = redis_server_factory(port="auto")
    with replica.client() as c:
        c.replicaof("127.0.0.1", primary.port)
    assert wait_for(lambda: replicated(primary, [replica]), 10.0), "replica never synced"
    yield primary, replica
    if replica.pid is not None:
        os.kill(replica.pid, signal.SIGCONT)


def lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int) -> None:
    rcv, snd = d.receiver(room, PREFILL_ADDR), p.sender(room)
    rcv.init([1, 2])
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    assert rcv.poll() == KVPoll.Success
    aborted = d.receiver(room + 1, PREFILL_ADDR)
    aborted.init([3])
    aborted.abort("client went away")
    for part in (snd, rcv, aborted):
        part.clear()


def test_wait_rides_in_the_round_trip_it_confirms(
    primary_replica: tuple[RedisProcess, RedisProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Durable mode costs no round trip: WAIT goes in the same write as the finish and
    the abort it confirms (and only with those); the rest of a lifecycle is unchanged."""
    primary, _ = primary_replica
    trips = 0
    real = wire.roundtrip

    def counted(*args: Any) -> list[Any]:
        nonlocal trips
        trips += 1
        return real(*args)

    monkeypatch.setattr(wire, "roundtrip", counted)
    per_mode: dict[bool, tuple[int, int]] = {}
    for durable in (False, True):
        store = kvstate.connect(f"{primary.tcp_url}?durable={durable}", namespace="dur")
        assert store.options.durable is durable
        p, d = managers(store, lease=600.0)
        with p, d, primary.client() as admin:
            lifecycle(p, d, 10)  # warm: registry read, scripts
            admin.config_resetstat()
            trips = 0
            lifecycle(p, d, 20)
            waits = int(admin.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
            per_mode[durable] = (trips, waits)
        store.close()
    assert per_mode[True][0] == per_mode[False][0], per_mode
    assert per_mode[False][1] == 0 and per_mode[True][1] == 2, per_mode  # finish, abort
    print(f"\n[durable-round-trips] per_lifecycle_and_abort={per_mode}")


def test_durable_scripts_write_even_when_repeated(
    primary_replica: tuple[RedisProcess, RedisProcess],
) -> None:
    """WAIT confirms what the connection has written (docs/design.md, Durable mode): a
    finish or an abort repeated after an unconfirmed one must still write, or its WAIT
    could confirm nothing while the first write is not on a replica."""
    primary, _ = primary_replica
    store = kvstate.connect(f"{primary.tcp_url}?durable=true", namespace="again")

    def offset() -> int:
        with primary.client() as c:
            return int(c.info("replication")["master_repl_offset"])

    p, d = managers(store, lease=600.0)
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        rcv.init([1])
        snd.poll()
        snd.begin_transfer()
        abort = functools.partial(store.abort, 1, "client went away")
        for call, again in ((snd.finish_transfer, KVPoll.Success), (abort, 0)):
            call()
            before = offset()
            assert call() == again  # answered again: Success stays, nothing more fails
            assert offset() > before, call
        for part in (snd, rcv):
            part.clear()
    store.close()


def test_unconfirmed_is_refused_within_call_timeout(
    primary_replica: tuple[RedisProcess, RedisProcess],
) -> None:
    """The replica stopped (SIGSTOP): without durable mode the finish is acknowledged at
    once though no replica has it; with it, finish_transfer() and abort() raise
    DurabilityError within call_timeout and the sender is not Success. Once the replica
    is back, the same call (idempotent) is acknowledged."""
    primary, replica = primary_replica
    ct = scaled(1.5)
    plain = kvstate.connect(f"{primary.tcp_url}?call_timeout={ct}", namespace="stop")
    store = kvstate.connect(
        primary.tcp_url, namespace="stop", options=Options(durable=True, call_timeout=ct)
    )
    p_plain = kvstate.KVManager(plain, "prefill", "p1", "10.0.0.9:1", lease=600.0)
    p, d = managers(store, lease=600.0)
    with p, d, p_plain:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        other, orcv = p_plain.sender(2), d.receiver(2, "10.0.0.9:1")
        for r in (rcv, orcv):
            r.init([1])
        for s in (snd, other):
            assert s.poll() == KVPoll.WaitingForInput and s.begin_transfer() == KVPoll.Transferring
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGSTOP)
        assert other.finish_transfer() == KVPoll.Success  # acknowledged, on the primary only
        t0 = time.monotonic()
        with pytest.raises(DurabilityError) as info:
            snd.finish_transfer()
        took = time.monotonic() - t0
        assert took < 1.5 * ct, took
        text = str(info.value)
        assert "no replica confirmed" in text and store.url in text and "idempotent" in text
        assert isinstance(info.value, StateConnectionError) and "\n" not in text
        assert snd.status == KVPoll.Transferring  # not acknowledged
        aborted = d.receiver(3, PREFILL_ADDR)
        aborted.init([1])
        t0 = time.monotonic()
        with pytest.raises(DurabilityError):
            aborted.abort("client went away")
        abort_took = time.monotonic() - t0
        assert abort_took < 1.5 * ct, abort_took
        os.kill(replica.pid, signal.SIGCONT)
        assert snd.finish_transfer() == KVPoll.Success  # confirmed this time
        assert rcv.poll() == KVPoll.Success
        aborted.abort("client went away")
        assert aborted.poll() == KVPoll.Failed
        for part in (snd, rcv, other, orcv, aborted):
            part.clear()
    assert keys_of(store) == []
    store.close()
    plain.close()
    print(
        f"\n[durable-unconfirmed] call_timeout_s={ct}, finish_s={took:.2f}, "
        f"abort_s={abort_took:.2f}"
    )


def test_without_a_replica_or_without_wait_rights(
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    """Durable mode against a server with no replica says durability was not confirmed
    (WAIT gives up within one socket wait, shorter than the call here); under an engine
    ACL without +wait it names the ACL (docs/security.md's line adds +wait)."""
    server = redis_server_factory(port="auto")
    ct = scaled(1.0)
    query = f"durable=true&call_timeout={ct}&socket_timeout={ct / 2}"
    store = kvstate.connect(f"{server.tcp_url}?{query}", namespace="acl")
    with kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR) as p:
        snd = p.sender(1)
        snd.poll()
        with pytest.raises(DurabilityError, match="answered 0"):
            snd.finish_transfer()
        snd.clear()
    store.close()
    with server.client() as admin:
        setuser(admin, engine_acl(admin), "acl")  # no +wait
    store = kvstate.connect(f"{user_url(server)}?durable=true", namespace="acl")
    with kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR) as p:
        snd = p.sender(1)
        snd.poll()
        with pytest.raises(StateConnectionError, match="refused a command under its ACL"):
            snd.finish_transfer()
        snd.clear()
    store.close()


# --------------------------------------------------------------------------- Cluster


def cluster_rooms(store: Store, port: int, count: int, start: int = 0) -> list[int]:
    """Rooms whose slot the primary on ``port`` serves."""
    out, room = [], start
    while len(out) < count:
        key = store.keys.participant(room, "tx", "x")
        if int(store.client.get_node_from_key(key).port) == port:  # type: ignore[union-attr]
            out.append(room)
        room += 1
    return out


def wait_promoted(cluster: RedisCluster, replica: RedisProcess, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    assert wait_for(lambda: _is_primary(cluster, replica), timeout), "replica never promoted"
    return time.monotonic() - t0


def _is_primary(cluster: RedisCluster, node: RedisProcess) -> bool:
    try:
        return cluster.role(node) == "master"
    except Exception:  # noqa: BLE001 - not answering yet
        return False


def rejoin(cluster: RedisCluster, node: RedisProcess, primary: RedisProcess) -> None:
    """Start a killed primary again: it comes back as its successor's replica."""
    node.restart()
    assert wait_for(
        lambda: node in cluster.replicas_of(primary) and replicated(primary, [node]), 30.0
    ), "the old primary did not rejoin as a replica"


def answered(call: Callable[[], KVPoll], until: float) -> KVPoll | None:
    """``call()``'s answer, retried through StateConnectionError (a failover) until
    ``until`` (monotonic); None if it never answered."""
    while time.monotonic() < until:
        try:
            return call()
        except StateConnectionError:
            time.sleep(0.05)
    return None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    c = RedisCluster(3, 1, tmp_path / "c").start()
    yield c
    c.stop()


@pytest.mark.slow
@pytest.mark.cluster
def test_replica_cut_off_then_primary_killed(cluster: RedisCluster) -> None:
    """The replica loses its link (and cannot resync), then its primary is SIGKILLed and
    the replica takes over. A plain finish_transfer() was acknowledged Success and that
    Success is gone on the new primary; the durable one refused to acknowledge
    (DurabilityError), and acknowledges once the shard has a replica again."""
    target = next(n for n in cluster.primaries() if n is not cluster.nodes[0])
    replica = cluster.replicas_of(target)[0]
    ct = scaled(2.0)
    plain = kvstate.connect(f"{cluster.url}?call_timeout={ct}", namespace="cut")
    durable = kvstate.connect(f"{cluster.url}?call_timeout={ct}&durable=true", namespace="cut")
    room_plain, room_durable = cluster_rooms(plain, target.port, 2)
    lease = 600.0
    with (
        kvstate.KVManager(plain, "prefill", "p-plain", "10.0.0.1:1", lease=lease) as pp,
        kvstate.KVManager(durable, "prefill", "p-durable", "10.0.0.2:1", lease=lease) as pd,
        kvstate.KVManager(plain, "decode", "d0", "10.0.0.3:1", lease=lease) as d,
    ):
        snd_p, rcv_p = pp.sender(room_plain), d.receiver(room_plain, "10.0.0.1:1")
        snd_d, rcv_d = pd.sender(room_durable), d.receiver(room_durable, "10.0.0.2:1")
        for snd, rcv in ((snd_p, rcv_p), (snd_d, rcv_d)):
            rcv.init([1, 2])
            assert snd.poll() == KVPoll.WaitingForInput
            assert snd.begin_transfer() == KVPoll.Transferring
        assert wait_for(lambda: replicated(target, [replica]), 10.0)
        with replica.client() as c:  # it may not come back: AUTH fails on every try
            c.config_set("masterauth", "not-the-password")
        with target.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "slave")
        assert snd_p.finish_transfer() == KVPoll.Success  # acknowledged
        with pytest.raises(DurabilityError):
            snd_d.finish_transfer()
        assert snd_d.status == KVPoll.Transferring

        target.kill()
        failover_s = wait_promoted(cluster, replica)
        until = time.monotonic() + scaled(30)
        lost = answered(rcv_p.poll, until)
        assert lost is not None and lost != KVPoll.Success, lost  # the plain Success is gone
        with pytest.raises(DurabilityError):  # the new primary has no replica yet
            snd_d.finish_transfer()
        rejoin(cluster, target, replica)
        assert answered(snd_d.finish_transfer, until) == KVPoll.Success
        assert answered(rcv_d.poll, until) == KVPoll.Success
        for part in (snd_p, rcv_p, snd_d, rcv_d):
            part.clear()
    plain.close()
    durable.close()
    print(f"\n[durable-cut-off] failover_s={failover_s:.2f}, plain_receiver_after={lost.name}")


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: list[tuple[int, str, float]] = []  # (room, what, when)
        self.lost: list[tuple[int, str, str]] = []
        self.refused: dict[int, str] = {}  # room -> the error it raised (not acknowledged)
        self.cleared: list[tuple[int, float]] = []  # (room, when its clears answered)

    def note(self, room: int, exc: Exception) -> None:
        with self.lock:
            self.refused[room] = type(exc).__name__

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind in self.refused.values():
            out[kind] = out.get(kind, 0) + 1
        return out


def durable_lifecycle(
    tally: Tally, p: kvstate.KVManager, d: kvstate.KVManager, room: int, abort: bool
) -> None:
    """One room; whatever was acknowledged (a Success, an abort) must be what the other
    side finds, however long a failover makes it wait."""
    snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
    try:
        try:
            rcv.init([1, 2])
            snd.poll()
            if abort:
                rcv.abort("client went away")
                what, check, want = "abort", snd.poll, KVPoll.Failed
            else:
                snd.begin_transfer()
                if snd.finish_transfer() != KVPoll.Success:
                    return
                what, check, want = "Success", rcv.poll, KVPoll.Success
        except StateConnectionError as exc:  # DurabilityError included
            tally.note(room, exc)
            return
        with tally.lock:
            tally.acked.append((room, what, time.monotonic()))
        until = time.monotonic() + scaled(60)
        got = answered(check, until)
        while got not in (want, None, KVPoll.Failed) and time.monotonic() < until:
            time.sleep(0.05)
            got = answered(check, until)
        if got != want:
            with tally.lock:
                tally.lost.append((room, what, "no answer" if got is None else got.name))
    finally:
        for part in (snd, rcv):
            answered(lambda part=part: part.clear() or KVPoll.Failed, time.monotonic() + 60)
        with tally.lock:
            tally.cleared.append((room, time.monotonic()))


@pytest.mark.slow
@pytest.mark.cluster
def test_primary_sigkilled_under_load_loses_no_acknowledged_success(
    cluster: RedisCluster,
) -> None:
    """Four threads run lifecycles (one in five aborted by its receiver) on one
    primary's rooms in durable mode; the primary is SIGKILLed mid-load, its replica
    takes over, and the killed node comes back as the new replica. Every Success and
    abort that was acknowledged is found by the other side afterwards."""
    target = next(n for n in cluster.primaries() if n is not cluster.nodes[0])
    replica = cluster.replicas_of(target)[0]
    store = kvstate.connect(f"{cluster.url}?durable=true", namespace="load")
    rooms = iter(cluster_rooms(store, target.port, 5000))
    rooms_lock = threading.Lock()
    p, d = managers(store, lease=600.0)
    tally = Tally()
    stop = threading.Event()

    def worker() -> None:
        n = 0
        while not stop.is_set():
            with rooms_lock:
                room = next(rooms)
            n += 1
            durable_lifecycle(tally, p, d, room, abort=n % 5 == 0)

    with p, d:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        assert wait_for(lambda: len(tally.acked) >= 40, 60.0), "no load"
        killed_at = time.monotonic()
        target.kill()
        failover_s = wait_promoted(cluster, replica)
        promoted_at = time.monotonic()
        rejoin(cluster, target, replica)
        after = len(tally.acked)
        wait_for(lambda: len(tally.acked) >= after + 20, 30.0)  # durable again
        stop.set()
        for t in threads:
            t.join(scaled(120))
        assert not any(t.is_alive() for t in threads), "a lifecycle hung"
    just_before = [a for a in tally.acked if killed_at - 0.5 <= a[2] <= killed_at]
    print(
        f"\n[durable-sigkill] acknowledged={len(tally.acked)}, "
        f"acknowledged_in_the_last_500ms_before_the_kill={len(just_before)}, "
        f"after_the_node_rejoined={len(tally.acked) - after}, failover_s={failover_s:.2f}, "
        f"refused={tally.kinds()}, lost={tally.lost}"
    )
    assert tally.lost == [], tally.lost
    assert len(tally.acked) >= after + 20, "durable calls were not acknowledged again"
    # A call cut by the kill may have run without its answer: what its participants
    # cannot know they created waits for the audit or the room TTL. So does a clear the
    # killed primary answered but had not yet replicated (durable mode WAITs for
    # Success and aborts only): its keys are back on the promoted replica.
    assert_every_key_has_ttl(store)
    left = {store.keys.parse_room_key(k) for k in keys_of(store)}
    racing = {r for r, t in tally.cleared if killed_at - scaled(1.0) <= t <= promoted_at}
    assert {k.room for k in left if k is not None} <= set(tally.refused) | racing, left
    store.close()
