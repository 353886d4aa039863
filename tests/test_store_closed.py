"""Closed means closed, for a Store: after ``close()`` every call on it, and on what was
made on it, raises one ClosedError saying what to do, and writes nothing; a KVManager
cannot be made on it. (redis-py alone would reconnect and go on.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import ClosedError, KVStateError
from kvstate.ops import reads
from kvstate.ops.monitor import Monitor
from kvstate.store import Store
from tests.helpers import PREFILL_ADDR, managers, snapshot


def room_state(store: Store) -> dict[str, object]:
    """Every key but the engines' (their heartbeats run on stores of their own)."""
    return {k: v for k, v in snapshot(store).items() if ":engine" not in k}


def test_every_call_on_a_closed_store_raises_closed_error(state_url: str) -> None:
    store = kvstate.connect(state_url, namespace="closed")
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        rcv.init([1, 2])
        assert snd.poll() == KVPoll.WaitingForInput
        fresh = d.receiver(2, PREFILL_ADDR)
        spy = kvstate.connect(state_url, namespace="closed")
        before = room_state(spy)
        store.close()
        calls: dict[str, Callable[[], object]] = {
            "ping": store.ping,
            "execute": lambda: store.execute([reads.hash_of(snd.key)]),
            "scan": lambda: list(store.scan(store.keys.all_pattern)),
            "nodes": store.nodes,
            "server_time_ms": store.server_time_ms,
            "server_info": store.server_info,
            "load_scripts": store.load_scripts,
            "members": lambda: store.members(1),
            "store.abort": lambda: store.abort(1, "x"),
            "store.clear": lambda: store.clear(1, "tx", p.engine),
            "dedicated": store.dedicated,
            "KVManager": lambda: kvstate.KVManager(store, "prefill", "p9"),
            "Monitor.sweep": lambda: Monitor(store).sweep(),
            "poll": snd.poll,
            "init (fresh)": lambda: fresh.init([3]),
            "begin_transfer": snd.begin_transfer,
            "finish_transfer": snd.finish_transfer,
            "abort": lambda: rcv.abort("x"),
            "fail": lambda: rcv.fail("x"),
            "clear": snd.clear,
            "poll_many": lambda: p.poll_many([1]),
            "clear_many": lambda: d.clear_many([1]),
            "fail_peer": lambda: d.fail_peer(PREFILL_ADDR, "x"),
        }
        for name, call in calls.items():
            with pytest.raises(ClosedError) as info:
                call()
            text = str(info.value)
            assert "was closed" in text and "kvstate.connect()" in text, (name, text)
            assert "\n" not in text and store.url in text, (name, text)
            assert isinstance(info.value, KVStateError)
        store.close()  # idempotent
        assert room_state(spy) == before  # nothing written
        spy.close()
