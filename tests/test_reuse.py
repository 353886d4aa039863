"""A room id used again after its room failed (issue 29: SGLang hands both sides only
``bootstrap_room``, and a client may send the same one twice): the failure mark belongs
to the failed request. It names that request's participants (those the room had when it
failed and the late joiners it failed since); once all of them cleared, a named engine
joining the room again starts a new request. An engine the mark does not name is a late
joiner of the failed request and starts Failed, as before. Standalone and a 3-primary
Cluster, on real Redis.
"""

from __future__ import annotations

import json

import numpy as np

import kvstate
from kvstate import KVPoll
from kvstate.store import Store
from tests.helpers import PREFILL_ADDR, keys_of, managers, room_keys

NAMESPACE = "reuse"  # of the ``store`` fixture (tests/conftest.py)


def named(store: Store, room: int) -> dict[str, str]:
    """The failure mark as redis-cli shows it: ``reason`` and the named members."""
    raw = store.client.hgetall(store.keys.aborted(room))
    return {k.decode(): v.decode() for k, v in raw.items()}


def to_success(snd: kvstate.KVSender, rcv: kvstate.KVReceiver) -> None:
    """A new request's room, from publish to Success on both sides, then cleared."""
    assert rcv.init(np.arange(4)) == KVPoll.WaitingForInput
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    assert snd.finish_transfer() == KVPoll.Success
    assert rcv.poll() == KVPoll.Success
    snd.clear()
    rcv.clear()


def test_a_room_id_used_again_after_an_abort_is_a_new_request(store: Store) -> None:
    """Both sides joined, the router aborted, both cleared: the same room id again, in
    either order of joining, runs to Success and leaves no key, the mark included."""
    p, d = managers(store)
    with p, d:
        for room, decode_first in ((1, True), (2, False)):
            snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
            assert snd.poll() == rcv.poll() == KVPoll.Bootstrapping  # both created
            rcv.abort("client gave up")
            assert named(store, room) == {
                "reason": "client gave up (by rx:decode-b.tp0)",
                "tx:prefill-a.tp0": "",
                "rx:decode-b.tp0": "",
            }
            snd.clear()
            rcv.clear()
            if decode_first:
                rcv = d.receiver(room, PREFILL_ADDR)
                snd = p.sender(room)
            else:
                snd = p.sender(room)
                rcv = d.receiver(room, PREFILL_ADDR)
            to_success(snd, rcv)
            assert room_keys(store, room, marks=True) == []


def test_a_late_joiner_of_the_failed_request_still_fails(store: Store) -> None:
    """The decode failed and cleared before the prefill joined: the prefill is a late
    joiner of that request (the mark does not name its engine), so it starts Failed with
    the reason instead of waiting out its bootstrap timeout, and is named from then on:
    once it cleared too, the next request under the id is new on both sides."""
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(3, PREFILL_ADDR)
        assert rcv.poll() == KVPoll.Bootstrapping
        rcv.abort("decode out of memory")
        rcv.clear()
        late = p.sender(3)
        assert late.poll() == KVPoll.Failed
        assert late.reason.startswith("decode out of memory")
        assert set(named(store, 3)) == {"reason", "rx:decode-b.tp0", "tx:prefill-a.tp0"}
        late.clear()
        snd, rcv = p.sender(3), d.receiver(3, PREFILL_ADDR)
        to_success(snd, rcv)
        assert room_keys(store, 3, marks=True) == []


def test_a_pre_emptive_abort_fails_both_late_joiners_then_lets_the_id_go(store: Store) -> None:
    """A router aborts before either side joined (the mark names nobody): each side
    that joins later starts Failed, and after both cleared the id is free again."""
    store.abort(4, "router timed out")
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(4, PREFILL_ADDR)
        assert rcv.poll() == KVPoll.Failed
        rcv.clear()
        snd = p.sender(4)
        assert snd.poll() == KVPoll.Failed
        snd.clear()
        snd, rcv = p.sender(4), d.receiver(4, PREFILL_ADDR)
        to_success(snd, rcv)
        assert keys_of(store, marks=True) == keys_of(store)  # no mark left


def test_no_new_request_while_a_participant_of_the_failed_one_is_left(store: Store) -> None:
    """The decode comes back under the id while the failed request's sender has not
    cleared yet: its new receiver starts Failed (two requests never share a room),
    and the mark stays until the id is free of them both."""
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(5), d.receiver(5, PREFILL_ADDR)
        assert snd.poll() == rcv.poll() == KVPoll.Bootstrapping
        snd.abort("prefill rank lost")
        rcv.clear()
        again = d.receiver(5, PREFILL_ADDR)
        assert again.poll() == KVPoll.Failed
        assert again.reason.startswith("prefill rank lost")
        assert named(store, 5)["reason"] == again.reason  # the mark stays
        again.clear()
        snd.clear()
        snd, rcv = p.sender(5), d.receiver(5, PREFILL_ADDR)
        to_success(snd, rcv)
        assert room_keys(store, 5, marks=True) == []


def test_another_engine_is_a_late_joiner_even_after_all_cleared(store: Store) -> None:
    """Across TP: the mark names each rank. A rank that had no participant in the failed
    request (here a second decode rank the abort came before) starts Failed even once
    the room is empty; the ranks it names start the new request."""
    p, d = managers(store)
    d2 = kvstate.KVManager(store, "decode", "decode-b.tp1", "10.0.0.2:8999")
    with p, d, d2:
        snd, rcv = p.sender(6), d.receiver(6, PREFILL_ADDR)
        assert snd.poll() == rcv.poll() == KVPoll.Bootstrapping
        snd.abort("aborted")
        snd.clear()
        rcv.clear()
        other = d2.receiver(6, PREFILL_ADDR)
        assert other.poll() == KVPoll.Failed
        other.clear()
        snd, rcv = p.sender(6), d.receiver(6, PREFILL_ADDR)
        to_success(snd, rcv)
        assert room_keys(store, 6, marks=True) == []


def test_a_traced_new_request_says_the_room_was_failed(store_url: str) -> None:
    """In a traced room the new request's first participant is created with ``was:
    Failed``, after the failed request's entries, on the same trace."""
    options = kvstate.Options(trace_rate=1.0, trace_ttl=30.0)
    store = kvstate.connect(store_url, namespace="reuse-traced", options=options)
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(7), d.receiver(7, PREFILL_ADDR)
        assert snd.poll() == rcv.poll() == KVPoll.Bootstrapping
        rcv.abort("client gave up")
        snd.clear()
        rcv.clear()
        again = d.receiver(7, PREFILL_ADDR)
        assert again.poll() == KVPoll.Bootstrapping
        entries = [json.loads(e) for e in store.client.lrange(store.keys.trace(7), 0, -1)]
        created = [e for e in entries if e["event"] == "created"]
        assert created[-1]["engine"] == "decode-b.tp0"
        assert created[-1]["status"] == "Bootstrapping" and created[-1]["was"] == "Failed"
        assert [e.get("was") for e in created[:-1]] == [None, None]
        again.clear()
    store.close()
