"""kvstate in the shapes of a real deployment (issue 8), with real processes against real
redis-server: tensor-parallel prefill ranks that register late and in any order, a prefill
rank restarted under its name, a decode rank SIGKILLed, two processes claiming one engine
name, a receiver made before its prefill exists, a heartbeat whose workload holds every
connection, send()'s failure boundary, and fork.

Leases are short (0.5-1 s); waits poll a condition with generous bounds. Figures are
printed (``pytest -s``) for docs/faults.md's table.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import kvstate
from kvstate import KVPoll
from kvstate.errors import ForkedManagerError, KVStateError
from kvstate.ops import reads
from kvstate.store import Store
from tests import workers
from tests.helpers import assert_every_key_has_ttl, keys_of, room_keys, scaled, wait_for

ADDR = "10.8.8.8:8998"
NS = "shapes"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def report(name: str, **figures: object) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in figures.items()))


NAMESPACE = NS  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


class Procs:
    """Spawned workers, all SIGKILLed at the end of the test."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.started: list[Any] = []

    def start(self, target: Any, *args: Any) -> Any:
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            if proc.is_alive():
                proc.kill()
            proc.join(scaled(10))


@pytest.fixture
def procs(spawn_ctx: Any) -> Iterator[Procs]:
    p = Procs(spawn_ctx)
    yield p
    p.stop()


def get(q: Any, kind: str, timeout: float = 60.0) -> tuple:
    """The next message of ``kind`` (others of other kinds are kept for later)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg[0] == kind:
            return msg  # type: ignore[no-any-return]
        q.put(msg)
        time.sleep(0.01)


# --------------------------------------------------------------------------- TP ranks


@pytest.mark.parametrize("ranks,seed", [(2, 1), (4, 2)])
def test_tp_ranks_registering_late_in_random_order(
    store: Store, state_url: str, procs: Procs, ranks: int, seed: int
) -> None:
    """Receivers made before any prefill rank registered (and more after the first one
    did) bind every rank as it comes up, at its incarnation, and reach Success only with
    every rank's ack: the rank that registers last holds its finish, and meanwhile no
    receiver may be Success."""
    rng = random.Random(seed)
    order = list(range(ranks))
    rng.shuffle(order)
    engines = [f"prefill-t.tp{i}" for i in range(ranks)]
    last = engines[order[-1]]
    early, late = list(range(100, 106)), list(range(200, 206))
    results, hold = procs.ctx.Queue(), procs.ctx.Event()
    with kvstate.KVManager(store, "decode", "decode-t.tp0", lease=1.0) as d:
        rcvs = {r: d.receiver(r, ADDR) for r in early}
        for r, rcv in rcvs.items():
            assert rcv.init([r % 50, r % 50 + 1]) == KVPoll.Bootstrapping  # nobody there yet

        def start(i: int) -> tuple[Any, ...]:
            """Rank i's process; answers its "ready" (the order is the shuffled one, by
            handshake: start delays alone let a loaded host register them out of it)."""
            procs.start(
                workers.prefill_rank,
                state_url,
                NS,
                engines[i],
                ADDR,
                ranks,
                1.0,
                0.0,
                early + late,
                results,
                hold if engines[i] == last else None,
            )
            msg: tuple[Any, ...] = get(results, "ready")
            assert msg[1] == engines[i], msg
            return msg

        first = start(order[0])
        for r in late:  # made after a first rank registered, before the others did
            rcvs[r] = d.receiver(r, ADDR)
            rcvs[r].init([r % 50])
        assert first[1] != last or ranks == 1
        incs = {first[1]: first[2]}
        for i in order[1:]:
            msg = start(i)
            incs[msg[1]] = msg[2]
        # every receiver binds every rank (its next operations do the binding)
        assert wait_for(
            lambda: all(
                rcv.poll() in (KVPoll.WaitingForInput, KVPoll.Failed)
                and rcv.senders == sorted(engines)
                for rcv in rcvs.values()
            ),
            30.0,
        )
        get(results, "holding")
        done = [get(results, "done") for _ in range(ranks - 1)]
        assert all(st == "Success" for _, _, out in done for st, _ in out.values())
        # all ranks but one finished: not one receiver may be Success
        got = d.poll_many(list(rcvs))
        assert set(got.values()) == {KVPoll.WaitingForInput}, got
        for r in rcvs:
            raw = store.client.hgetall(store.keys.participant(r, "rx", d.engine))
            rx = {_text(k): _text(v) for k, v in raw.items()}
            assert rx["peers"] == str(ranks)
            assert {
                k[5:]: v for k, v in rx.items() if k.startswith("peer:")
            } == incs  # each at its current incarnation
        hold.set()
        out = get(results, "done")[2]
        assert all(st == "Success" for st, _ in out.values()), out
        assert wait_for(lambda: set(d.poll_many(list(rcvs)).values()) == {KVPoll.Success}, 10.0)
        for r in rcvs:
            acks = store.execute([reads.acks_of(store.keys, r, d.engine)])[0]
            assert acks == sorted(engines)
            rcvs[r].clear()
    report("tp-ranks", ranks=ranks, order=[engines[i] for i in order], rooms=len(rcvs))


def test_ranks_without_a_declared_size_bind_all_registered(store: Store) -> None:
    """Without ``ranks``, a receiver needs the ranks registered at its first binding: one
    made after tp1 registered binds both (the old per-address cache kept ['tp0'])."""
    with (
        kvstate.KVManager(store, "decode", "decode-t.tp0", lease=1.0) as d,
        kvstate.KVManager(store, "prefill", "prefill-t.tp0", ADDR, lease=1.0) as p0,
    ):
        first = d.receiver(1, ADDR)
        first.init([1])
        assert first.senders == ["prefill-t.tp0"]
        with kvstate.KVManager(store, "prefill", "prefill-t.tp1", ADDR, lease=1.0) as p1:
            later = d.receiver(2, ADDR)
            later.init([2])
            assert later.senders == ["prefill-t.tp0", "prefill-t.tp1"]
            s0, s1 = p0.sender(2), p1.sender(2)
            for s in (s0, s1):
                assert s.poll() == KVPoll.WaitingForInput
            s0.begin_transfer()
            s0.finish_transfer()
            assert later.poll() == KVPoll.WaitingForInput  # tp1 has not acked
            s1.begin_transfer()
            s1.finish_transfer()
            assert later.poll() == KVPoll.Success
            for part in (s0, s1, later, first):
                part.clear()
    assert keys_of(store) == []


# --------------------------------------------------------------------------- restarts


def test_prefill_rank_restarted_under_its_name(store: Store, state_url: str, procs: Procs) -> None:
    """A prefill rank SIGKILLed and started again under the same name: rooms bound to the
    old incarnation fail naming it; the new process waits out the old lease (never
    displacing a live one), and receivers made afterwards bind the new incarnation and
    complete."""
    lease = 1.0
    engine = "prefill-r.tp0"
    results = procs.ctx.Queue()
    old = procs.start(workers.prefill_rank, state_url, NS, engine, ADDR, 1, lease, 0.0, [], results)
    old_inc = get(results, "ready")[2]
    with kvstate.KVManager(store, "decode", "decode-r.tp0", lease=lease) as d:
        bound_old = [d.receiver(r, ADDR) for r in (1, 2, 3)]
        for rcv in bound_old:
            assert rcv.init([1, 2]) == KVPoll.WaitingForInput
        t0 = time.monotonic()
        old.kill()
        procs.start(
            workers.prefill_rank, state_url, NS, engine, ADDR, 1, lease, 0.0, [10, 11], results
        )
        new_inc = get(results, "ready")[2]
        registered_s = time.monotonic() - t0
        assert new_inc != old_inc
        assert wait_for(lambda: all(r.poll() == KVPoll.Failed for r in bound_old), 2 * lease + 1.5)
        failed_s = time.monotonic() - t0
        for rcv in bound_old:
            reason = rcv.failure_exception().reason
            assert engine in reason and old_inc in reason, reason
        fresh = [d.receiver(r, ADDR) for r in (10, 11)]
        for rcv in fresh:
            rcv.init([5])
        for rcv in fresh:
            key = store.keys.participant(rcv.room, "rx", d.engine)
            assert store.client.hget(key, f"peer:{engine}") == new_inc.encode()
        assert wait_for(lambda: all(r.poll() == KVPoll.Success for r in fresh), 30.0)
        for rcv in fresh:
            rcv.clear()
    report(
        "prefill-restart",
        lease_s=lease,
        new_registered_after_s=f"{registered_s:.2f}",
        old_rooms_failed_after_s=f"{failed_s:.2f}",
    )


def test_decode_rank_sigkilled_fails_prefill_senders(
    store: Store, state_url: str, procs: Procs
) -> None:
    """A decode rank SIGKILLed after publishing: the prefill heartbeat watches the
    receivers of its live senders and fails them, naming the peer, within 2 leases;
    begin_transfer() then refuses."""
    lease = 1.0
    results = procs.ctx.Queue()
    rooms = [31, 32, 33, 34]
    with kvstate.KVManager(store, "prefill", "prefill-k.tp0", ADDR, lease=lease) as p:
        senders = {r: p.sender(r) for r in rooms}
        dec = procs.start(
            workers.decode_rank, state_url, NS, "decode-k.tp0", ADDR, lease, rooms, results
        )
        get(results, "published")
        assert wait_for(lambda: set(p.poll_many(rooms).values()) == {KVPoll.WaitingForInput}, 10.0)
        assert senders[31].begin_transfer() == KVPoll.Transferring  # one was mid-transfer
        t0 = time.monotonic()
        os.kill(dec.pid, signal.SIGKILL)
        assert wait_for(
            lambda: set(p.poll_many(rooms).values()) == {KVPoll.Failed}, 2 * lease + 1.5, step=0.02
        )
        detected_s = time.monotonic() - t0
        for snd in senders.values():
            assert snd.begin_transfer() == KVPoll.Failed
            assert "receiver decode-k.tp0 lost its lease" in snd.reason, snd.reason
            snd.clear()
    report("decode-sigkill", lease_s=lease, prefill_detected_after_s=f"{detected_s:.2f}")


# --------------------------------------------------------------------------- one owner


def test_stale_process_whose_lease_was_taken_stops(
    store: Store, state_url: str, procs: Procs
) -> None:
    """A process stopped past its lease (SIGSTOP) while another registers its name: when
    it resumes, its renewal is answered 'taken'; it stops renewing (the new owner keeps
    the name), fails its own rooms with the reason, and refuses new participants naming
    the holder."""
    lease = 0.5
    results = procs.ctx.Queue()
    stale = procs.start(workers.stale_owner, state_url, NS, "prefill-s.tp0", lease, 40, results)
    old_inc = get(results, "ready")[1]
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        assert wait_for(
            lambda: not store.client.exists(store.keys.engine("prefill-s.tp0")), 5 * lease
        )
        with kvstate.KVManager(store, "prefill", "prefill-s.tp0", lease=lease) as owner:
            os.kill(stale.pid, signal.SIGCONT)
            t0 = time.monotonic()
            _, inc, text = get(results, "refused", 10.0)
            stopped_s = time.monotonic() - t0
            assert inc == old_inc and owner.incarnation in text and f"pid {os.getpid()}" in text
            for _ in range(3):  # an absence: look after each of the stale one's periods
                time.sleep(lease / 5)
                now = owner.registry.get("prefill-s.tp0")
                assert now is not None and now.incarnation == owner.incarnation
            st = store.execute([store.poll(40, "tx", "prefill-s.tp0")])[0]
            assert st.status == KVPoll.Failed and "took the name" in st.reason
            store.clear(40, "tx", "prefill-s.tp0")
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    report("stale-owner", lease_s=lease, stale_stopped_after_resume_s=f"{stopped_s:.2f}")


# --------------------------------------------------------------------------- bootstrap


def test_receiver_before_its_prefill_registers(store: Store) -> None:
    """Construction never raises for a prefill that is not up: the receiver stays
    Bootstrapping, binds when the prefill registers, and without one fails after
    bootstrap_timeout (server clock) saying how many senders it had."""
    with kvstate.KVManager(store, "decode", "decode-b.tp0", lease=1.0, bootstrap_timeout=0.5) as d:
        waits = d.receiver(1, ADDR)
        never = d.receiver(2, "10.7.7.7:1")
        assert waits.init([1]) == KVPoll.Bootstrapping
        assert never.poll() == KVPoll.Bootstrapping
        with kvstate.KVManager(store, "prefill", "prefill-b.tp0", ADDR, lease=1.0) as p:
            assert waits.poll() == KVPoll.WaitingForInput and waits.senders == [p.engine]
            snd = p.sender(1)
            assert snd.poll() == KVPoll.WaitingForInput
            snd.begin_transfer()
            snd.finish_transfer()
            assert waits.poll() == KVPoll.Success
            snd.clear()
        assert wait_for(lambda: never.poll() == KVPoll.Failed, 5.0)
        reason = never.failure_exception().reason
        assert "bootstrap timeout" in reason and "bound 0 of ? senders at 10.7.7.7:1" in reason
        waits.clear()
    assert keys_of(store) == []


# --------------------------------------------------------------------------- heartbeat


def test_heartbeat_survives_a_starved_pool(redis_server_factory: Callable[..., Any]) -> None:
    """The workload holds every connection of its pool in blocking calls and the server is
    at maxclients: the heartbeat renews on its own connection, so no lease lapses and no
    live room fails (with the shared pool the lease lapsed and rooms failed)."""
    proc = redis_server_factory(port="auto")
    store = kvstate.connect(proc.unix_url, namespace=NS)
    lease = 0.6
    admin = proc.client(socket_timeout=5.0)
    with (
        kvstate.KVManager(store, "prefill", "prefill-h.tp0", ADDR, lease=lease) as p,
        kvstate.KVManager(store, "decode", "decode-h.tp0", lease=lease) as d,
    ):
        snd, rcv = p.sender(1), d.receiver(1, ADDR)
        rcv.init([1])
        assert snd.poll() == KVPoll.WaitingForInput
        hogs = [
            threading.Thread(
                target=lambda: store.client.blpop(["kvstate-test-hog"], 6 * lease), daemon=True
            )
            for _ in range(4)
        ]
        for t in hogs:
            t.start()
        assert wait_for(lambda: int(admin.info("clients")["blocked_clients"]) == 4, 5.0)
        admin.config_set("maxclients", int(admin.info("clients")["connected_clients"]))
        try:
            with pytest.raises(redis.ConnectionError):  # no new connection for anyone
                proc.client(socket_timeout=2.0, retry=None).ping()
            for _ in range(int(4 * lease / (lease / 3))):  # 4 leases of heartbeats
                time.sleep(lease / 3)
                for m in (p, d):
                    now = admin.hget(store.keys.engine(m.engine), "incarnation")
                    assert now == m.incarnation.encode(), f"{m.engine} lost its lease"
        finally:
            admin.config_set("maxclients", 10000)
        for t in hogs:
            t.join(scaled(10))
        assert snd.poll() == KVPoll.WaitingForInput and rcv.poll() == KVPoll.WaitingForInput
        snd.clear()
        rcv.clear()
    assert keys_of(store) == []
    admin.close()
    store.close()


# --------------------------------------------------------------------------- send()


def test_send_boundary_aborts_the_room(redis_url: str, procs: Procs) -> None:
    """A UCX prefill whose receiver's engine is gone when send() looks it up: the room is
    aborted with the reason on both sides (was: TransportError out of send(), both sides
    WaitingForInput). Without a transport send() refuses, pointing to begin/finish."""
    store = kvstate.connect(redis_url, namespace=NS)  # UCX workers: standalone only
    results, go = procs.ctx.Queue(), procs.ctx.Event()
    procs.start(
        workers.ucx_prefill,
        redis_url,
        NS,
        "prefill-x.tp0",
        ADDR,
        {5: [1, 2]},
        1,
        2,
        64,
        results,
        go,
    )
    get(results, "ready")
    d = kvstate.KVManager(store, "decode", "decode-x.tp0", lease=1.0)
    rcv = d.receiver(5, ADDR)
    assert rcv.init([7, 8]) == KVPoll.WaitingForInput
    d.close()  # its registration (endpoint, layout) is gone; the receiver's keys are not
    go.set()
    status, reason = get(results, "prefill")[1][5]
    assert status == "Failed" and "transfer failed" in reason and "decode-x.tp0" in reason
    rx = store.client.hgetall(store.keys.participant(5, "rx", "decode-x.tp0"))
    assert rx[b"status"] == b"Failed" and b"transfer failed" in rx[b"reason"]
    # its manager is closed (its calls refused): the keys go through the Store
    store.clear(5, "rx", "decode-x.tp0", senders=rcv.senders, peer_addr=ADDR)
    with kvstate.KVManager(store, "prefill", "prefill-y.tp0", "10.6.6.6:1") as p:
        snd = p.sender(6)
        with pytest.raises(KVStateError, match=r"begin_transfer\(\) and finish_transfer\(\)"):
            snd.send([1])
        assert room_keys(store, 6) == []  # refused before anything was written
        assert snd.fail(None) == KVPoll.Failed  # SGLang passes None; was redis-py's DataError
        assert "no reason given" in snd.failure_exception().reason
    assert_every_key_has_ttl(store)
    store.close()


# --------------------------------------------------------------------------- fork


def test_fork_child_refuses_the_parents_manager(store: Store) -> None:
    """A forked child cannot use its parent's manager (ForkedManagerError says what to
    do), and its close() leaves the parent's lease alone."""
    lease = 0.6
    with kvstate.KVManager(store, "prefill", "prefill-f.tp0", ADDR, lease=lease) as p:
        snd = p.sender(1)
        snd.poll()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 0
            try:
                try:
                    p.sender(2)
                    code |= 1
                except ForkedManagerError as exc:
                    code |= 0 if "new kvstate.connect()" in str(exc) else 2
                try:
                    snd.poll()
                    code |= 4
                except ForkedManagerError:
                    pass
                p.close()  # must not drop the parent's registration
            except BaseException:  # noqa: BLE001 - any surprise is a failure code
                code |= 8
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        info = p.registry.get(p.engine)
        assert info is not None and info.incarnation == p.incarnation
        assert p.registry.renew(p.info, lease).answer == "renewed"  # never lapsed
        assert p.heartbeat.running and snd.poll() == KVPoll.Bootstrapping
        snd.clear()
    assert keys_of(store) == []


# --------------------------------------------------------------------------- smaller ones


def test_init_after_success_changes_nothing(store: Store) -> None:
    """A late init() (a race, or a retry) after Success leaves the receiver Success
    (publish.lua used to fail it without an abort)."""
    with (
        kvstate.KVManager(store, "prefill", "prefill-i.tp0", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-i.tp0") as d,
    ):
        rcv, snd = d.receiver(1, ADDR), p.sender(1)
        rcv.init([1])
        snd.poll()
        snd.begin_transfer()
        snd.finish_transfer()
        assert rcv.poll() == KVPoll.Success
        snd.fail("failed after it finished")  # a sender Failed now must not matter either
        assert rcv.init([2]) == KVPoll.Success and rcv.poll() == KVPoll.Success
        for part in (snd, rcv):
            part.clear()
    assert keys_of(store) == []


def test_fan_out_reaches_a_receiver_that_outlived_its_tracker_entry(store: Store) -> None:
    """The address tracker expires with the room TTL from a receiver's creation, while
    status changes keep the receiver alive longer: the decode heartbeat fails its own
    receivers by key too, so a dead prefill still reaches them."""
    lease = 0.6
    d = kvstate.KVManager(store, "decode", "decode-o.tp0", lease=lease)
    p = kvstate.KVManager(store, "prefill", "prefill-o.tp0", ADDR, lease=lease)
    rcv = d.receiver(1, ADDR)
    assert rcv.init([1]) == KVPoll.WaitingForInput
    store.client.delete(store.keys.tracker(ADDR, 1))  # as if expired
    p.close()
    assert wait_for(lambda: rcv.poll() == KVPoll.Failed, 2 * lease + 1.5)
    assert "prefill-o.tp0" in rcv.reason and "lost its lease" in rcv.reason
    rcv.clear()
    d.close()
    assert keys_of(store) == []


def test_sender_poll_returns_infos_only_when_they_changed(store: Store) -> None:
    """poll.lua sends a sender's transfer infos only when their version (bumped by each
    publish) differs from the one the client holds."""
    with (
        kvstate.KVManager(store, "prefill", "prefill-v.tp0", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-v.tp0") as d,
    ):
        snd = p.sender(1, required_receivers=1)
        rcv = d.receiver(1, ADDR)
        rcv.init(list(range(0, 2000, 2)))
        assert snd.poll() == KVPoll.WaitingForInput and "decode-v.tp0" in snd.transfer_infos()
        held = snd._infos_version
        again = store.execute([store.poll(1, "tx", p.engine, True, held)])[0]
        assert again.status == KVPoll.WaitingForInput and again.infos == {}
        assert again.version == -1
        stale = store.execute([store.poll(1, "tx", p.engine, True, held - 1)])[0]
        assert set(stale.infos) == {"decode-v.tp0"} and stale.version == held
        rcv.init([7, 9])  # published again: the next poll brings the new info
        snd.poll()
        assert snd.transfer_infos()["decode-v.tp0"].kv_indices.tolist() == [7, 9]
        snd.clear()


def test_init_refused_by_redis_says_why(redis_server_factory: Callable[..., Any]) -> None:
    """A transfer info above Redis's proto-max-bulk-len: Redis drops the connection. init()
    raises a KVStateError naming the size and the setting, and the receiver it created
    is Failed with that reason (was: left Bootstrapping, error read 'is Redis running?')."""
    proc = redis_server_factory(port="auto")
    with proc.client() as c:
        c.config_set("proto-max-bulk-len", "1mb")
    store = kvstate.connect(proc.unix_url, namespace=NS)
    with (
        kvstate.KVManager(store, "prefill", "prefill-m.tp0", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-m.tp0") as d,
    ):
        rcv = d.receiver(1, ADDR)
        with pytest.raises(KVStateError, match="proto-max-bulk-len") as err:
            rcv.init(list(range(0, 600_000, 2)))  # 300k runs: 2.4 MB
        assert re.search(r"transfer info is \d{7} bytes", str(err.value)), str(err.value)
        assert rcv.poll() == KVPoll.Failed and "proto-max-bulk-len" in rcv.reason
        rcv.clear()
        # the room failed: a sender that joins starts Failed with that reason, and no
        # transfer info reached it
        late = p.sender(1)
        assert late.poll() == KVPoll.Failed and "proto-max-bulk-len" in late.reason
        fields = store.client.hkeys(store.keys.room_hash(1))
        assert fields == [b"tx:" + p.engine.encode()]  # its member only: no xfer: field
        late.clear()
    assert keys_of(store) == []
    store.close()
