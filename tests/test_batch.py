"""Batched per-step calls (KVManager poll_many / init_many / begin_many / finish_many /
clear_many)
on real Redis, standalone and a 3-primary Cluster: one round trip per node, the same
answers as the one-room calls, partial results when a node is unreachable, no key left."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import KVStateError, NotReadyError, StateConnectionError
from kvstate.store import Store
from kvstate.testing import RoundTrips
from tests.helpers import PREFILL_ADDR, keys_of, managers
from tests.proxy import ProxiedCluster, rooms_by_port

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
            # + 2: the registry read (the address's index, then its engines), once
            assert rt.count - before <= _nodes(store) + 2
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
        assert not store.client.zrange(store.keys.addr(PREFILL_ADDR), 0, -1)


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
        assert out[2] == KVPoll.Failed and "decode ran out of pages" in snd[2]._reason
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


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_batches_partial_when_a_node_stalls(tmp_path: Path) -> None:
    """One primary stalled: the batched calls answer for the rooms on the healthy
    primaries and list the others in ``.errors``; clear_many clears what it can, keeps
    the rest live, and clears them once the node is back: nothing left."""
    pc = ProxiedCluster(tmp_path)
    try:
        opts = kvstate.Options(call_timeout=1.5)
        store = kvstate.connect(pc.url, namespace="batchfault", options=opts)
        p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=60.0)
        d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=60.0)
        by_port = rooms_by_port(store, 24)
        bad = set(by_port[pc.proxy.port])
        rooms = list(range(24))
        for r in rooms:
            p.sender(r)
            d.receiver(r, PREFILL_ADDR).init([1, 2])
        assert p.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.WaitingForInput)

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
