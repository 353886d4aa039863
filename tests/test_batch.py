"""Batched per-step calls (KVManager poll_many / init_many / begin_many / finish_many /
clear_many)
on real Redis, standalone and a 3-primary Cluster: one round trip per node, the same
answers as the one-room calls, partial results when a node is unreachable, no key left."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import (
    CorruptStateError,
    InvalidArgumentError,
    KVStateError,
    NotReadyError,
    StateConnectionError,
)
from kvstate.store import Store, command_call
from kvstate.testing import RoundTrips
from tests.helpers import PREFILL_ADDR, keys_of, managers
from tests.proxy import ProxiedCluster, waiting_rooms

NAMESPACE = "batch"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


def _nodes(store: Store) -> int:
    return len(store.nodes())


def test_step_batches_one_round_trip_per_node(store: Store) -> None:
    p, d = managers(store, lease=60.0)
    rooms = list(range(40))
    with p, d:
        senders = {r: p.sender(r) for r in rooms}
        receivers = {r: d.receiver(r, PREFILL_ADDR) for r in rooms}
        with RoundTrips.installed() as rt:
            before = rt.count
            pages = {r: np.arange(r, r + 8) for r in rooms}
            inited = d.init_many(pages)  # creates, tracks, binds and publishes
            # standalone: the registry read is inside each publish.lua (one trip); a
            # Cluster: + 1, the address's index read once (another slot)
            assert rt.count - before <= _nodes(store) + (1 if store.cluster else 0)
            assert inited == dict.fromkeys(rooms, KVPoll.WaitingForInput)
            assert all(r.senders == [p.engine] for r in receivers.values())
            before = rt.count
            polled = p.poll_many(rooms)  # creates every sender in the same trip
            assert rt.count - before <= _nodes(store)
            assert polled == dict.fromkeys(rooms, KVPoll.WaitingForInput)
            assert all(s.transfer_infos() for s in senders.values())  # came with the poll

            before = rt.count
            begun = p.begin_many(rooms)
            assert rt.count - before <= _nodes(store)
            assert begun == dict.fromkeys(rooms, KVPoll.Transferring) and not begun.errors

            before = rt.count
            done = p.finish_many(rooms)
            assert rt.count - before <= _nodes(store)
            assert done == dict.fromkeys(rooms, KVPoll.Success)
            assert d.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.Success)

            before = rt.count
            assert p.clear_many(rooms) == {}
            assert rt.count - before <= _nodes(store)
            before = rt.count
            assert d.clear_many(rooms) == {}
            assert rt.count - before <= _nodes(store)
        assert all(s.cleared for s in senders.values())
        assert p.clear_many(rooms) == {}  # again: nothing to do, nothing sent
        assert [k for k in keys_of(store) if ":engine" not in k] == []
        assert not any(store.client.exists(t) for t in store.keys.trackers(PREFILL_ADDR))


def test_single_lifecycle_round_trips(store: Store) -> None:
    """A room's whole lifecycle, one call at a time (a poll each, both clears): 7 round
    trips on a standalone server, the receiver's registry read folded into its first
    publish.lua; at most 10 on a Cluster (the index read, and the receiver's create
    and clear also reach the address tracker's node). Fails if a round trip is added."""
    p, d = managers(store, lease=60.0)
    with p, d:
        for room in (1, 2):  # the first warms the scripts
            with RoundTrips.installed() as rt:
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
                trips = rt.count - before
            assert rcv.senders == [p.engine]
            # a Cluster counts one trip per node reached: 8-10 by where the room's slot
            # and the tracker's and index's keys fall
            assert trips <= 10 if store.cluster else trips == 7, trips
    assert keys_of(store) == []


def test_binding_follows_the_registry(store: Store) -> None:
    """A receiver binds the engine registered at its address now, at its incarnation:
    a prefill restarted under the same name is bound at its new incarnation, one whose
    lease lapsed is not bound, and a group's declared size (``ranks``) is waited for."""
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998", lease=60.0)
    with d:
        old = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, lease=60.0)
        old_inc = old.incarnation
        old.close()
        rcv = d.receiver(1, PREFILL_ADDR)
        assert rcv.init([1]) == KVPoll.Bootstrapping and rcv.senders == []
        with kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, lease=60.0) as p:
            assert p.incarnation != old_inc
            assert rcv.poll() == KVPoll.WaitingForInput and rcv.senders == [p.engine]
            assert rcv.bound == {p.engine: p.incarnation}
            assert p.sender(1).poll() == KVPoll.WaitingForInput
            # found and published in one batch: init's own publish is left out
            rcv2 = d.receiver(2, PREFILL_ADDR)
            assert rcv2.init([2]) == KVPoll.WaitingForInput
            assert p.sender(2).poll() == KVPoll.WaitingForInput
            p.clear_many([1, 2])
        d.clear_many([1, 2])
        # a lapsed lease (heartbeat stopped, key and index deadline past) binds nothing
        lapsed = kvstate.KVManager(store, "prefill", "prefill-c.tp0", "10.7.7.7:1", lease=0.3)
        lapsed.heartbeat.stop()
        time.sleep(0.5)
        rcv3 = d.receiver(3, "10.7.7.7:1")
        assert rcv3.init([3]) == KVPoll.Bootstrapping and rcv3.senders == []
        lapsed.close()
        # two ranks declared: the first one up is bound, the receiver waits for the other
        with kvstate.KVManager(store, "prefill", "g.tp0", "10.8.8.8:1", lease=60.0, ranks=2) as g0:
            rcv4 = d.receiver(4, "10.8.8.8:1")
            assert rcv4.init([4]) == KVPoll.Bootstrapping and rcv4.senders == [g0.engine]
            with kvstate.KVManager(store, "prefill", "g.tp1", "10.8.8.8:1", lease=60.0, ranks=2):
                assert rcv4.poll() == KVPoll.WaitingForInput
                assert rcv4.senders == ["g.tp0", "g.tp1"]
        d.clear_many([3, 4])
    assert keys_of(store) == []


def test_a_receiver_given_its_count_binds_before_it_waits(store: Store) -> None:
    """A receiver made with ``required_senders`` (or named senders) starts with none
    bound: its ``init`` binds and publishes to that many before it reads
    WaitingForInput (a stored count of bound senders is dropped once it equals peers,
    so a new one must store 0: without it the receiver read as bound, published to
    nobody and its sender never became ready). By address and by name, in one call."""
    p, d = managers(store, lease=60.0)
    with p, d:
        snd = {r: p.sender(r) for r in (1, 2)}
        p.poll_many([1, 2])
        by_addr = d.receiver(1, PREFILL_ADDR, required_senders=1)
        by_name = d.receiver(2, PREFILL_ADDR, senders=[p.engine])
        with RoundTrips.installed() as rt:
            before = rt.count
            assert d.init_many({1: [1], 2: [2]}) == {
                1: KVPoll.WaitingForInput,
                2: KVPoll.WaitingForInput,
            }
            # standalone: the named registrations read inside publish.lua, one trip
            assert rt.count - before <= _nodes(store) + (1 if store.cluster else 0)
        assert by_addr.bound == by_name.bound == {p.engine: p.incarnation}
        assert p.poll_many([1, 2]) == {1: KVPoll.WaitingForInput, 2: KVPoll.WaitingForInput}
        assert [s.published for s in snd.values()] == [[d.engine], [d.engine]]
        assert not store.client.hexists(by_addr.key, "bound")  # dropped once all bound
        p.clear_many([1, 2])
        d.clear_many([1, 2])
    assert keys_of(store) == []


def test_corrupt_index_is_named(store: Store) -> None:
    """An address index that is not a sorted set: the binding raises CorruptStateError
    naming it (read inside publish.lua on a standalone server, by index.lua on a
    Cluster), and the receiver fails, as for any corrupt key met by init()."""
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998", lease=60.0)
    index = store.keys.engines_at("10.6.6.6:1")
    store.execute([command_call("SET", index, args=["garbage", "PX", 60_000])])
    with d:
        rcv = d.receiver(1, "10.6.6.6:1")
        with pytest.raises(CorruptStateError) as err:
            rcv.init([1])
        assert err.value.key == index, err.value
        assert rcv.status == KVPoll.Failed
        rcv.clear()
    store.execute([command_call("DEL", index)])
    assert keys_of(store) == []


def test_begin_many_refuses_where_a_single_begin_would(store: Store) -> None:
    """A failed receiver fails its sender's begin in the batch, the others begin; a
    sender that has seen no infos yet is only polled; unknown rooms are refused."""
    p, d = managers(store, lease=60.0)
    with p, d:
        snd = {r: p.sender(r) for r in (1, 2, 3)}
        rcv = {r: d.receiver(r, PREFILL_ADDR) for r in (1, 2)}
        for r in rcv.values():
            r.init([4, 5])
        p.poll_many([1, 2, 3])
        rcv[2].fail("decode ran out of pages")
        out = p.begin_many([1, 2, 3])
        assert out[1] == KVPoll.Transferring
        assert out[2] == KVPoll.Failed and "decode ran out of pages" in snd[2].reason
        # no receiver published: only polled, and refused (nothing written)
        assert 3 not in out and isinstance(out.errors[3], NotReadyError)
        assert snd[3].status == KVPoll.Bootstrapping
        with pytest.raises(KVStateError, match="no live participant"):
            p.begin_many([99])
        with pytest.raises(KVStateError, match="decode manager"):
            p.init_many({1: [1]})
        with pytest.raises(KVStateError, match="prefill manager"):
            d.finish_many([1])
        assert p.finish_many([1]) == {1: KVPoll.Success}
        assert rcv[1].poll() == KVPoll.Success
        assert p.clear_many([1, 2, 3, 42]) == {}
        assert d.clear_many([1, 2]) == {}
    assert keys_of(store) == []


def test_a_poll_begins_what_it_finds_ready(store: Store) -> None:
    """``poll_many(begin=True)``: a sender its receivers published to is begun in the
    poll's own call (Transferring, its infos read: one round trip per node for the
    step, not two); one whose receiver failed, or cleared (its info went with it), is
    Failed with the reason and marks the room, as begin_many would; a sender no
    receiver published to stays Bootstrapping, nothing written."""
    p, d = managers(store, lease=60.0)
    rooms = [1, 2, 3, 4]
    with p, d:
        snd = {r: p.sender(r) for r in rooms}
        p.poll_many(rooms)  # created, Bootstrapping
        rcv = {r: d.receiver(r, PREFILL_ADDR) for r in (1, 2, 3)}
        d.init_many({r: [r, r + 10] for r in rcv})
        rcv[2].fail("decode ran out of pages")
        rcv[3].clear()  # gave up without failing: its info went with it
        with RoundTrips.installed() as rt:
            before = rt.count
            out = p.poll_many(rooms, begin=True)
            assert rt.count - before <= _nodes(store)
        assert out == {
            1: KVPoll.Transferring,
            2: KVPoll.Failed,
            3: KVPoll.Failed,
            4: KVPoll.Bootstrapping,
        }
        assert [i.kv_indices.tolist() for i in snd[1].transfer_infos().values()] == [[1, 11]]
        assert "decode ran out of pages" in snd[2].reason
        assert "receivers are gone (cleared) before the transfer" in snd[3].reason
        assert store.client.exists(store.keys.aborted(3))  # the room failed
        assert p.finish_many([1]) == {1: KVPoll.Success}
        assert rcv[1].poll() == KVPoll.Success
        with pytest.raises(KVStateError, match="prefill manager"):
            d.poll_many([1], begin=True)
        with pytest.raises(KVStateError, match="prefill manager"):
            d.poll_changed(begin=True)
        assert p.clear_many(rooms) == {}
        assert d.clear_many([1, 2]) == {}
    store.execute([command_call("DEL", store.keys.aborted(r)) for r in (2, 3)])
    assert keys_of(store) == []


def test_clears_ride_the_next_batch(store: Store) -> None:
    """``clear_many(later=True)`` sends nothing; the manager's next batch carries the
    clears in its own round trip per node (MULTI/EXEC beside its calls), and
    ``poll_changed`` makes one for them alone when no room is due; ``close()`` makes
    those still due."""
    p, d = managers(store, lease=60.0)
    with p, d:
        snd = {r: p.sender(r) for r in (1, 2, 3)}
        rcv = {r: d.receiver(r, PREFILL_ADDR) for r in (1, 2, 3)}
        p.poll_many([1, 2, 3])  # created: a create begins nothing
        d.init_many({r: [r] for r in rcv})
        assert p.poll_many([1, 2, 3], begin=True) == dict.fromkeys((1, 2, 3), KVPoll.Transferring)
        assert p.finish_many([1, 2]) == {1: KVPoll.Success, 2: KVPoll.Success}
        with RoundTrips.installed() as rt:
            before = rt.count
            assert p.clear_many([1, 2], later=True) == {}
            assert rt.count == before and p.clearing == [1, 2]
            assert not snd[1].cleared and store.client.exists(snd[1].key)
            before = rt.count
            assert p.finish_many([3]) == {3: KVPoll.Success}  # carries 1 and 2
            assert rt.count - before <= _nodes(store)
            assert snd[1].cleared and snd[2].cleared and p.clearing == []
            assert not store.client.exists(snd[1].key, snd[2].key)
            assert snd[1].status == KVPoll.Success  # its last status stands
            p.clear_many([3], later=True)
            before = rt.count
            assert p.poll_changed() == {}  # no room due: the clear alone
            assert rt.count - before <= _nodes(store)
            assert p.live_rooms == [] and snd[3].cleared
            assert d.poll_many([1, 2, 3]) == dict.fromkeys((1, 2, 3), KVPoll.Success)
            d.clear_many([1, 2, 3], later=True)
        # a new participant of a room whose clear is due (the same keys): that clear is
        # made before the new one's create, which starts the room over
        old = p.sender(9)
        old.abort("the request was cancelled")
        p.clear_many([9], later=True)
        new = p.sender(9)
        assert p.poll_many([9]) == {9: KVPoll.Bootstrapping} and new.reason == ""
        assert old.cleared and p.clearing == []
        p.clear_many([9])
        store.execute([command_call("DEL", store.keys.aborted(9))])
    assert rcv[3].cleared  # close() made the clears still due
    assert keys_of(store) == []


def test_abort_many_fails_every_room_in_three_round_trips_per_node(store: Store) -> None:
    """A step that gives up on many rooms: each fails for both sides with its own
    reason, in three round trips per node whatever their number (read the rooms'
    participants, fail them, read the statuses back; a fourth first creates the
    participants never written). What abort_many would refuse is refused before
    anything is sent; nothing is left once both sides cleared."""
    p, d = managers(store, lease=60.0)
    with p, d, RoundTrips.installed() as rt:
        rooms = list(range(30))
        senders = {r: p.sender(r) for r in rooms}
        receivers = {r: d.receiver(r, PREFILL_ADDR) for r in rooms}
        d.init_many({r: np.arange(4) for r in rooms})
        assert p.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.WaitingForInput)
        fresh = p.sender(31)  # never written: the abort creates it

        before = rt.count
        with pytest.raises(KVStateError, match="no live participant"):
            p.abort_many({99: "x"})
        with pytest.raises(InvalidArgumentError, match="must be text"):
            p.abort_many({0: 5})  # type: ignore[dict-item]
        assert p.abort_many({}) == {}
        assert rt.count == before and not store.client.exists(store.keys.aborted(0))

        for group, most in ((rooms[:1], 3), (rooms[1:], 3), ([31], 4)):
            before = rt.count
            out = p.abort_many({r: f"stop {r}" for r in group})
            assert rt.count - before <= most * _nodes(store), group
            assert out == dict.fromkeys(group, KVPoll.Failed) and not out.errors
        assert fresh.reason.startswith(f"stop 31 (by tx:{p.engine})")
        assert all(senders[r].reason.startswith(f"stop {r} (by tx:") for r in rooms)
        assert d.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.Failed)
        assert all(receivers[r].reason.startswith(f"stop {r} (by tx:") for r in rooms)
        assert p.clear_many([*rooms, 31]) == {}
        assert d.clear_many(rooms) == {}
    assert [k for k in keys_of(store) if ":engine" not in k and not store.keys.is_mark(k)] == []


def proxied_pair(
    pc: ProxiedCluster, namespace: str
) -> tuple[Store, kvstate.KVManager, kvstate.KVManager, list[int], set[int]]:
    """A prefill and a decode manager on ``pc`` (``call_timeout`` 1.5 s), 24 rooms
    WaitingForInput, and which of them live on the proxied primary."""
    opts = kvstate.Options(call_timeout=1.5)
    store = kvstate.connect(pc.url, namespace=namespace, options=opts)
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=60.0)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=60.0)
    rooms, bad = waiting_rooms(pc, store, p, d, 24)
    return store, p, d, rooms, bad


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_batches_partial_when_a_node_stalls(tmp_path: Path) -> None:
    """One primary stalled: the batched calls answer for the rooms on the healthy
    primaries and list the others in ``.errors``; clear_many clears what it can, keeps
    the rest live, and clears them once the node is back: nothing left."""
    pc = ProxiedCluster(tmp_path)
    try:
        store, p, d, rooms, bad = proxied_pair(pc, "batchfault")
        pc.proxy.stall()
        begun = p.begin_many(rooms)
        assert set(begun.errors) == bad and set(begun) == set(rooms) - bad
        assert set(begun.values()) == {KVPoll.Transferring}
        for err in begun.errors.values():
            assert isinstance(err, StateConnectionError)
            assert f"Cluster node 127.0.0.1:{pc.proxy.port}" in str(err)
        left = p.clear_many(rooms)
        assert set(left) == bad
        assert all(isinstance(e, StateConnectionError) for e in left.values())

        pc.proxy.passthrough()
        assert p.clear_many(rooms) == {}
        assert d.clear_many(rooms) == {}
        p.close()
        d.close()
        assert keys_of(store) == []
        store.close()
    finally:
        pc.close()


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_abort_many_partial_when_a_node_is_down(tmp_path: Path) -> None:
    """One primary down: abort_many fails the rooms on the others and lists the down
    node's rooms in ``.errors`` (abort them again); once it is back, they abort too and
    nothing is left."""
    pc = ProxiedCluster(tmp_path)
    try:
        store, p, d, rooms, bad = proxied_pair(pc, "abortfault")
        pc.proxy.drop()
        out = p.abort_many(dict.fromkeys(rooms, "engine stops"))
        assert set(out.errors) == bad, (out, out.errors)
        assert set(out) == set(rooms) - bad
        assert set(out.values()) == {KVPoll.Failed}
        assert all(isinstance(e, StateConnectionError) for e in out.errors.values())

        pc.proxy.passthrough()
        again = p.abort_many(dict.fromkeys(bad, "engine stops"))
        assert again == dict.fromkeys(bad, KVPoll.Failed) and not again.errors
        assert d.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.Failed)
        assert p.clear_many(rooms) == {}
        assert d.clear_many(rooms) == {}
        p.close()
        d.close()
        assert [k for k in keys_of(store) if not store.keys.is_mark(k)] == []
        store.close()
    finally:
        pc.close()
