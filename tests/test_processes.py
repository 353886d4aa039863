"""State shared by real processes: racing updates, and a peer killed with SIGKILL."""

from __future__ import annotations

import os
import signal

import kvstate
from kvstate import KVPoll, schema
from kvstate.ops import reads
from kvstate.store import Store
from tests import workers
from tests.helpers import keys_of, room_keys, scaled, wait_for

NAMESPACE = "proc"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


def test_racing_processes_end_in_the_merged_state(store: Store, state_url: str, spawn_ctx) -> None:
    rooms = list(range(50, 70))
    racers = [f"tx-{i}" for i in range(4)]
    # the shared sender each racer updates; in a room of its own (room + ACKS: a Failed
    # shared sender fails its room, one outcome per room), each racer's sender and two
    # receivers needing 4 / 5 acks, bound to the racers (finish.lua counts only the acks
    # of senders a receiver is bound to, as publish.lua binds them)
    calls = []
    no_timeouts = {"peers": 1, "timeouts_ms": "0 0"}
    bound = {schema.peer_field(tx): "inc" for tx in racers}
    for room in rooms:
        calls.append(store.create(room, "tx", "shared", no_timeouts))
        for tx in racers:
            calls.append(store.create(room + workers.ACKS, "tx", tx, no_timeouts))
        for rx, peers in (("rx-4", 4), ("rx-5", 5)):
            calls.append(
                store.create(
                    room + workers.ACKS,
                    "rx",
                    rx,
                    {"peers": peers, "timeouts_ms": "0 0", **bound},
                )
            )
    store.execute(calls)
    start, results = spawn_ctx.Event(), spawn_ctx.Queue()
    procs = [
        spawn_ctx.Process(
            target=workers.race_updates, args=(state_url, "proc", name, rooms, seed, start, results)
        )
        for seed, name in enumerate(racers)
    ]
    for proc in procs:
        proc.start()
    start.set()
    applied = [results.get(timeout=scaled(120)) for _ in procs]
    for proc in procs:
        proc.join(scaled(30))
        assert proc.exitcode == 0
    for room in rooms:
        seen = [KVPoll[s] for log in applied for r, s in log if r == room]
        # merge rule: Failed is sticky, otherwise the max (Success never raced here)
        expect = KVPoll.Failed if KVPoll.Failed in seen else max(seen)
        tx = store.execute([store.poll(room, "tx", "shared")])[0]
        assert tx.status == expect, (room, seen)
        acked = room + workers.ACKS
        rx4, rx5 = (store.execute([store.poll(acked, "rx", r)])[0] for r in ("rx-4", "rx-5"))
        assert rx4.status == KVPoll.Success  # exactly 4 acks arrived
        assert rx5.status == KVPoll.Bootstrapping  # 4 of 5: not yet
        acks = store.execute([reads.acks_of(store.keys, acked, "rx-5")])[0]
        assert acks == sorted(racers)
    for room in rooms:
        store.clear(room, "tx", "shared")
        for tx in racers:
            store.clear(room + workers.ACKS, "tx", tx)
        store.clear(room + workers.ACKS, "rx", "rx-4")
        store.clear(room + workers.ACKS, "rx", "rx-5")
        assert room_keys(store, room) == [] and room_keys(store, room + workers.ACKS) == []


def test_killed_prefill_fails_bound_rooms_and_restart_does_not_inherit(
    store: Store, state_url: str, spawn_ctx
) -> None:
    lease = 1.0
    addr = "10.9.9.9:8998"
    ready = spawn_ctx.Event()
    proc = spawn_ctx.Process(
        target=workers.prefill_engine, args=(state_url, "proc", "prefill-z.tp0", addr, lease, ready)
    )
    proc.start()
    try:
        assert ready.wait(scaled(60))
        d = kvstate.KVManager(store, "decode", "decode-y.tp0", lease=lease)
        with d:
            old = d.receiver(80, addr)
            old.init([1, 2, 3])
            done = d.receiver(81, addr)
            done.init([4])
            store.execute(
                [  # the prefill engine's sender finished this one before dying
                    store.create(
                        81,
                        "tx",
                        "prefill-z.tp0",
                        {"peers": 1, "timeouts_ms": "0 0"},
                    ),
                    store.begin(81, "prefill-z.tp0", ["decode-y.tp0"]),
                    store.finish(81, "prefill-z.tp0", ["decode-y.tp0"]),
                ]
            )
            assert done.poll() == KVPoll.Success
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(scaled(10))
            assert wait_for(lambda: old.poll() == KVPoll.Failed, timeout=2 * lease + 0.5)
            reason = old.failure_exception().reason
            assert "prefill-z.tp0" in reason and addr in reason and "lease" in reason
            assert done.poll() == KVPoll.Success  # terminal rooms are left alone
            done.clear()
            store.clear(81, "tx", "prefill-z.tp0")
            store.clear(80, "tx", "prefill-z.tp0")

            # the engine comes back at the same address with a new incarnation
            ready2 = spawn_ctx.Event()
            proc = spawn_ctx.Process(
                target=workers.prefill_engine,
                args=(state_url, "proc", "prefill-z.tp0", addr, lease, ready2),
            )
            proc.start()
            assert ready2.wait(scaled(60))
            new = d.receiver(82, addr)
            new.init([5])
            assert new.poll() == KVPoll.WaitingForInput
            # an explicit fan-out for the old incarnation does not touch the new room
            old_inc = "0" * 16
            d.fail_peer(addr, "stale", engine="prefill-z.tp0", incarnation=old_inc)
            assert new.poll() == KVPoll.WaitingForInput
            new.clear()
        assert keys_of(store, store.keys.participant_pattern) == []
    finally:
        proc.kill()
        proc.join(scaled(10))
