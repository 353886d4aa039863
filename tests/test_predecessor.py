"""A rank restarted under its engine name clears what its killed predecessor left
(``KVManager.clear_predecessor``): the rooms fail, so their other side learns why at
once instead of waiting out a timeout, and the predecessor's keys go."""

from __future__ import annotations

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.store import Store, command_call
from kvstate.testing import RoundTrips
from tests.helpers import PREFILL_ADDR, keys_of, managers, room_keys


def test_a_restarted_decode_clears_what_its_killed_predecessor_left(store: Store) -> None:
    """A decode gone after one transfer landed and while another room waited: the rank
    restarted under its name fails those rooms (the prefill learns why) and deletes its
    predecessor's part, instead of both waiting for the rooms' TTL."""
    p, d = managers(store)
    with p:
        waiting, landed = p.sender(31), p.sender(32)
        with d:  # closed without clearing its receivers: as good as killed, for them
            d.receiver(31, PREFILL_ADDR).init(np.arange(4))
            d.receiver(32, PREFILL_ADDR).init(np.arange(4))
            assert waiting.poll() == KVPoll.WaitingForInput
            landed.begin_transfer()
            assert landed.finish_transfer() == KVPoll.Success
            landed.clear()  # the prefill is done with it; the decode never cleared
        left = [k for k in keys_of(store) if ":rx:" in k]
        assert len(left) == 2, "the closed decode's receivers stayed in Redis"
        with (
            kvstate.KVManager(store, "decode", d.engine, d.bootstrap_addr) as again,
            RoundTrips.installed() as rt,
        ):
            before = rt.by_thread["MainThread"]
            assert sorted(again.clear_predecessor()) == [31, 32]
            # the SCAN, then one batch for every room: read, abort (two), clear; one room
            # at a time it took five round trips each
            assert rt.by_thread["MainThread"] - before <= 5 * len(store.nodes())
            assert again.clear_predecessor() == []  # nothing twice
        assert waiting.poll() == KVPoll.Failed
        with pytest.raises(kvstate.KVTransferError, match="restarted"):
            raise waiting.failure_exception()  # type: ignore[misc]
        assert room_keys(store, 31) == [] and room_keys(store, 32) == []
    assert keys_of(store) == []


def test_only_its_own_name_is_cleared_even_with_glob_characters(store: Store) -> None:
    """An engine name may hold ``[``/``]`` (IPv6 addresses): the SCAN pattern takes them
    literally, so a rank never clears a neighbour's rooms."""
    name, other = "decode@[::1]:80/tp0", "decode@[::1]:80/tp1"
    with kvstate.KVManager(store, "prefill", "prefill-g.tp0", PREFILL_ADDR) as p:
        snd = p.sender(5, required_receivers=2)
        with (
            kvstate.KVManager(store, "decode", name, "a:1") as d0,
            kvstate.KVManager(store, "decode", other, "a:2") as d1,
        ):
            d0.receiver(5, PREFILL_ADDR).init(np.arange(2))
            keep = d1.receiver(5, PREFILL_ADDR)
            keep.init(np.arange(2))
        with kvstate.KVManager(store, "decode", name, "a:1") as again:
            assert again.clear_predecessor() == [5]
        neighbour = store.keys.participant(5, "rx", other)
        assert store.execute([command_call("EXISTS", neighbour)]) == [1]
        assert snd.poll() == KVPoll.Failed
        snd.clear()
        store.clear(5, "rx", other, senders=["prefill-g.tp0"], peer_addr=PREFILL_ADDR)
    assert keys_of(store) == []
