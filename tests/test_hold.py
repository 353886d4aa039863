"""A decode engine holds the rooms queued behind it (``Store.hold_many``, hold.lua):
their senders' bootstrap timeout waits for the hold, so a long decode queue does not
fail good requests, and a decode that stops holding frees the prefill's pages one
timeout later. A hold creates nothing, and goes with the room's clear."""

from __future__ import annotations

import time

import numpy as np

import kvstate
from kvstate import KVPoll
from kvstate.ops.views import room_view
from kvstate.store import Store, command_call
from tests.helpers import PREFILL_ADDR, keys_of, wait_for

CHECK_TTL = True


def test_a_held_sender_outlives_its_bootstrap_timeout_and_fails_once_the_hold_ends(
    store: Store,
) -> None:
    with kvstate.KVManager(store, "prefill", "p.hold", PREFILL_ADDR, bootstrap_timeout=0.5) as p:
        snd = p.sender(1)
        unheld = p.sender(2)
        assert snd.poll() == KVPoll.Bootstrapping and unheld.poll() == KVPoll.Bootstrapping
        until = time.monotonic() + 2.0
        while time.monotonic() < until:  # the decode's scheduler, holding every step
            assert store.hold_many([1], 1.0) == 1
            assert snd.poll() == KVPoll.Bootstrapping
            time.sleep(0.1)
        assert unheld.poll() == KVPoll.Failed and "bootstrap timeout" in unheld.reason
        assert room_view(store, 1).held_until_ms is not None
        # the decode dropped the request: the hold ends, then the timeout frees the pages
        assert wait_for(lambda: snd.poll() == KVPoll.Failed, 5.0)
        assert "bootstrap timeout" in snd.reason
        snd.clear()
        unheld.clear()
    assert keys_of(store) == []


def test_a_hold_creates_nothing_and_goes_with_the_clear(store: Store) -> None:
    assert store.hold_many([5, 6], 30.0) == 0
    assert keys_of(store) == []
    with (
        kvstate.KVManager(store, "prefill", "p.hold2", PREFILL_ADDR) as p,
        kvstate.KVManager(store, "decode", "d.hold2") as d,
    ):
        snd = p.sender(5)
        snd.poll()
        assert store.hold_many([5, 6], 30.0) == 1
        rcv = d.receiver(5, PREFILL_ADDR)
        rcv.init(np.arange(2))
        assert snd.poll() == KVPoll.WaitingForInput
        snd.begin_transfer()
        assert snd.finish_transfer() == KVPoll.Success and rcv.poll() == KVPoll.Success
        rcv.clear()
        snd.clear()
    assert keys_of(store) == []


def test_an_abort_does_not_count_the_hold_as_a_participant(store: Store) -> None:
    with kvstate.KVManager(store, "prefill", "p.hold3", PREFILL_ADDR) as p:
        snd = p.sender(9)
        snd.poll()
        store.hold_many([9], 30.0)
        assert store.abort(9, "router cancelled") == 1
        assert snd.poll() == KVPoll.Failed and "router cancelled" in snd.reason
        snd.clear()
    left = store.execute([command_call("EXISTS", store.keys.room_hash(9))])
    assert left == [0]
    assert keys_of(store) == []
