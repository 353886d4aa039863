"""clear() when Redis answers badly (issue 30): a clear that ran but whose reply was
lost leaves the participant cleared, its last status standing (a finished request
never turns Failed "state lost"); and a clear keeps its call_timeout when every
connection of the pool is taken and the server is at maxclients."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import KVStateError, StateConnectionError
from tests.helpers import PREFILL_ADDR, keys_of, scaled, wait_for
from tests.proxy import Proxy


@contextmanager
def _proxied(redis_proc: Any, namespace: str) -> Iterator[tuple[Proxy, Any, Any, float]]:
    """A prefill and a decode manager whose Redis is behind a proxy (it can mute the
    replies), their call_timeout; no key left once the test's rooms cleared."""
    with Proxy(("127.0.0.1", redis_proc.port)) as proxy:
        ct = scaled(1.5)
        store = kvstate.connect(f"{proxy.url()}?call_timeout={ct}", namespace=namespace)
        with (
            kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR) as p,
            kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1") as d,
        ):
            yield proxy, p, d, ct
        assert keys_of(store) == []
        store.close()


def test_a_clear_whose_reply_was_lost_reads_cleared_not_state_lost(
    redis_proc: Any, redis_tcp_url: str
) -> None:
    with _proxied(redis_proc, "lostclear") as (proxy, p, d, ct):
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        other = d.receiver(2, PREFILL_ADDR)
        rcv.init(np.arange(4))
        other.init(np.arange(4, 6))
        assert snd.poll() == KVPoll.WaitingForInput
        snd.begin_transfer()
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        proxy.mute()  # the clear reaches Redis and runs there; its reply is lost
        with pytest.raises(StateConnectionError):
            rcv.clear()
        proxy.passthrough()
        assert wait_for(lambda: _answers(rcv.poll), 4 * ct)
        # the scheduler reads again: still Success, and cleared (not "state lost")
        assert rcv.status == KVPoll.Success and rcv.reason == ""
        assert rcv.cleared and rcv.failure_exception() is None
        # the same for a step's clear_many (on a connection open before the fault)
        assert d.poll_many([2]) == {2: KVPoll.WaitingForInput}
        proxy.mute()
        with pytest.raises(StateConnectionError):
            d.clear_many([2])
        proxy.passthrough()
        assert wait_for(lambda: d.poll_many([2]) == {2: KVPoll.WaitingForInput}, 4 * ct)
        assert other.cleared and other.status == KVPoll.WaitingForInput
        assert d.live_rooms == []
        snd.clear()


def test_a_begin_or_clear_riding_a_poll_whose_reply_was_lost(
    redis_proc: Any, redis_tcp_url: str
) -> None:
    """``poll_many(begin=True)`` ran in Redis (the sender Transferring) but its reply
    was lost: the sender holds neither the status nor the infos. The next poll answers
    Transferring with the infos, so the pages are written and the room finishes: no
    second begin, no room left Transferring until its timeout. A clear riding a poll
    (``clear_many(later=True)``) whose reply was lost stays due and is made again
    with the next batch; the participant's Success stands."""
    with _proxied(redis_proc, "lostbegin") as (proxy, p, d, ct):
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        assert p.poll_many([1]) == {1: KVPoll.Bootstrapping}
        rcv.init(np.arange(4))
        proxy.mute()  # the begin runs in Redis; its reply is lost
        with pytest.raises(StateConnectionError):
            p.poll_many([1], begin=True)
        proxy.passthrough()
        assert snd.status == KVPoll.Bootstrapping and not snd.published
        assert wait_for(lambda: _answers(lambda: p.poll_many([1], begin=True)), 4 * ct)
        assert snd.status == KVPoll.Transferring
        assert [i.kv_indices.tolist() for i in snd.transfer_infos().values()] == [[0, 1, 2, 3]]
        assert p.finish_many([1]) == {1: KVPoll.Success}
        assert rcv.poll() == KVPoll.Success
        # its clear rides the next poll, whose reply is lost: due again, made again
        p.clear_many([1], later=True)
        proxy.mute()
        with pytest.raises(StateConnectionError):
            p.poll_changed()
        proxy.passthrough()
        assert p.clearing == [1] and not snd.cleared
        assert wait_for(lambda: _answers(p.poll_changed), 4 * ct)
        assert snd.cleared and snd.status == KVPoll.Success and p.clearing == []
        d.clear_many([1])


def test_a_finish_that_clears_concludes_its_room_even_with_its_reply_lost(
    redis_proc: Any, redis_tcp_url: str
) -> None:
    """``finish_many(clear=True)``: each sender it concludes is cleared in its round
    trip, its Success answered, its receiver Success. Its reply lost (the finish and
    the clear ran): no clear is left due to ride another batch, and the finish made
    again reads the sender cleared, its status Transferring, answered without a
    refusal; the receiver reads Success. A finish refused before anything is sent (a
    room with no sender here) leaves no clear due; made again, it finishes and clears."""
    with _proxied(redis_proc, "finishclear") as (proxy, p, d, ct):
        rooms = [1, 2, 3]
        snds, rcvs = _begun(p, d, rooms)
        assert p.finish_many([1], clear=True) == {1: KVPoll.Success}
        assert snds[0].cleared and p.live_rooms == [2, 3] and p.clearing == []
        assert rcvs[0].poll() == KVPoll.Success
        proxy.mute()  # the finish and its clear run in Redis; the reply is lost
        with pytest.raises(StateConnectionError):
            p.finish_many([2], clear=True)
        proxy.passthrough()
        assert p.clearing == [] and snds[1].status == KVPoll.Transferring
        again: list[Any] = []
        assert wait_for(
            lambda: _answers(lambda: again.append(p.finish_many([2], clear=True))), 4 * ct
        )
        assert again == [{2: KVPoll.Transferring}] and not again[0].errors
        assert snds[1].cleared and p.live_rooms == [3]
        assert rcvs[1].poll() == KVPoll.Success
        # a room the batch leaves unanswered (not sent at all) keeps its sender
        with pytest.raises(KVStateError):
            p.finish_many([3, 99], clear=True)
        assert p.clearing == [] and not snds[2].cleared
        assert p.finish_many([3], clear=True) == {3: KVPoll.Success}
        assert snds[2].cleared and p.live_rooms == []
        assert rcvs[2].poll() == KVPoll.Success
        d.clear_many(rooms)


def _begun(p: Any, d: Any, rooms: list[int]) -> tuple[list[Any], list[Any]]:
    """Senders and receivers of ``rooms``, each receiver published, each sender begun."""
    snds = [p.sender(r) for r in rooms]
    rcvs = [d.receiver(r, PREFILL_ADDR) for r in rooms]
    for i, rcv in enumerate(rcvs):
        rcv.init(np.arange(4 * i, 4 * i + 4))
    assert p.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.WaitingForInput)
    assert p.begin_many(rooms) == dict.fromkeys(rooms, KVPoll.Transferring)
    return snds, rcvs


def _answers(call: Callable[[], object]) -> bool:
    """Whether ``call`` reached Redis (a step's poll after the proxy let replies through)."""
    try:
        call()
    except StateConnectionError:
        return False
    return True


@pytest.mark.slow
def test_clear_keeps_its_call_timeout_when_the_pool_is_contended(
    redis_server_factory: Callable[..., Any],
) -> None:
    """192 clears at once, one thread each, on one store (more than its pool's 100
    connections), the server at maxclients 8: each ends, cleared or refused with the
    reason (the server's maxclients, or the pool staying full), within its call_timeout,
    like every other call; none retries past it."""
    server = redis_server_factory(port="auto")
    ct = scaled(2.0)
    store = kvstate.connect(f"{server.tcp_url}?call_timeout={ct}", namespace="pool")
    took: dict[str, float] = {}
    errors: list[str] = []
    with (
        kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR) as p,
        kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1") as d,
    ):
        pairs = []
        for room in range(96):
            snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
            rcv.init(np.arange(room * 2, room * 2 + 2))
            pairs.append((snd, rcv))
        p.poll_many(range(96))
        with server.client() as admin:
            admin.config_set("maxclients", 8)
            start = threading.Event()

            def clear(name: str, part: Any) -> None:
                start.wait()
                t0 = time.monotonic()
                try:
                    part.clear()
                except StateConnectionError as exc:
                    errors.append(str(exc))
                took[name] = time.monotonic() - t0

            threads = [
                threading.Thread(target=clear, args=(f"{side}{i}", part), daemon=True)
                for i, pair in enumerate(pairs)
                for side, part in zip(("tx", "rx"), pair, strict=True)
            ]
            for t in threads:
                t.start()
            start.set()
            for t in threads:
                t.join(scaled(60))
            admin.config_set("maxclients", 10000)
        assert len(took) == 192, "clears still blocked"
        slowest = max(took.values())
        assert slowest < ct + scaled(1.0), f"a clear took {slowest:.1f} s (call_timeout {ct} s)"
        for text in errors:
            assert "maxclients" in text or "stayed in use" in text, text
        for snd, rcv in pairs:  # the ones refused clear now
            snd.clear()
            rcv.clear()
    assert keys_of(store) == []
    store.close()


def test_a_finish_behind_the_step_ends_before_the_managers_next_call(
    redis_proc: Any, redis_tcp_url: str
) -> None:
    """``finish_many(wait=False)``, a push behind the step: the Future answers what the
    batch answers; the manager's next call, here the step's next poll, starts only
    once it ended, so it reads the room cleared. Its reply lost, the Future raises
    StateConnectionError and the finish made again reads the sender cleared; a close
    waits for it. ``clear_many(wait=False)`` whose reply was lost leaves its clears due."""
    with _proxied(redis_proc, "finishbehind") as (proxy, p, d, ct):
        rooms = [1, 2, 3]
        snds, rcvs = _begun(p, d, rooms)
        proxy.stall()  # nothing reaches Redis: the finish waits behind, not the caller
        running = p.finish_many([1], clear=True, wait=False)
        assert not running.done() and not snds[0].cleared
        proxy.passthrough()
        assert p.poll_many([3]) == {3: KVPoll.Transferring}
        assert running.done() and running.result() == {1: KVPoll.Success}
        assert snds[0].cleared and p.live_rooms == [2, 3]
        assert rcvs[0].poll() == KVPoll.Success
        proxy.mute()  # the finish and its clear run in Redis; the reply is lost
        lost = p.finish_many([2], clear=True, wait=False)
        with pytest.raises(StateConnectionError):
            lost.result()
        proxy.passthrough()
        again: list[Any] = []
        assert wait_for(
            lambda: _answers(lambda: again.append(p.finish_many([2], clear=True))), 4 * ct
        )
        assert again == [{2: KVPoll.Transferring}] and snds[1].cleared
        assert rcvs[1].poll() == KVPoll.Success
        # a close waits for the finish behind it
        last = p.finish_many([3], clear=True, wait=False)
        p.close()
        assert last.result() == {3: KVPoll.Success} and snds[2].cleared
        assert rcvs[2].poll() == KVPoll.Success
        # clear_many(wait=False): a clear whose reply was lost stays due, and rides the
        # next batch
        proxy.mute()
        failed = d.clear_many(rooms[:2], wait=False).result()
        assert set(failed) == {1, 2} and d.clearing == [1, 2]
        assert all(isinstance(e, StateConnectionError) for e in failed.values())
        proxy.passthrough()
        assert wait_for(lambda: _answers(d.poll_changed), 4 * ct)
        assert d.clearing == [] and rcvs[0].cleared and rcvs[1].cleared
        assert d.clear_many([3], wait=False).result() == {} and rcvs[2].cleared
