"""Change notices (docs/design.md, "Change notices"; issue 33 target 3): a waiting step
makes no round trip, a change another participant made is polled at the next step, and
lost notices (a killed subscription) or none at all (a timeout) still conclude every
room: a resubscribe polls everything, the sweep polls every waiting room."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

import kvstate
from kvstate import KVPoll
from kvstate.errors import InvalidOptionError
from kvstate.keys import Keys
from kvstate.store import Store, notices
from kvstate.testing import RedisProcess, RoundTrips
from tests.helpers import PREFILL_ADDR, managers, scaled, wait_for
from tests.proxy import ProxiedCluster, waiting_rooms

NAMESPACE = "notice.ns-1"  # '.' and '-': the Lua derivation of the channel must keep them
# no sweep within a test: only a notice (or a resubscribe) makes a waiting room polled
OPTIONS = kvstate.Options(notice_sweep=3600.0)
ROOMS = list(range(100, 116))


def quiet_step(mgr: kvstate.KVManager, rooms: list[int]) -> None:
    """Step until one makes no round trip (the subscription's confirmation, then the
    first polls, come first)."""
    assert wait_for(lambda: trips(mgr, rooms) == 0, 5.0), "a waiting step kept polling"


def trips(mgr: kvstate.KVManager, rooms: list[int]) -> int:
    """Round trips of one step (a Cluster's go out on a thread per node; the managers'
    heartbeats, every 20 s with their 60 s leases, fall outside a step)."""
    with RoundTrips.installed() as rt:
        before = rt.count
        mgr.poll_many(rooms)
        return rt.count - before


@pytest.fixture
def only_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notices reach the managers only through Redis (PUBLISH, the subscription), not
    from this process's own calls (``told_here``), which would mask the Lua side."""
    monkeypatch.setattr(notices, "told_here", lambda calls: None)


def test_waiting_step_makes_no_round_trip_and_a_change_is_polled(
    store: Store, only_redis: None
) -> None:
    p, d = managers(store, lease=60.0)
    with p, d:
        for r in ROOMS:
            p.sender(r)
            d.receiver(r, PREFILL_ADDR)
        assert set(p.poll_many(ROOMS).values()) == {KVPoll.Bootstrapping}
        quiet_step(p, ROOMS)
        for _ in range(3):
            assert trips(p, ROOMS) == 0
        assert d.init_many({ROOMS[3]: np.arange(4)})[ROOMS[3]] == KVPoll.WaitingForInput
        # publish.lua notified the prefill: its next step polls that room (the notice
        # crosses a Cluster's bus, hence the wait), no other room changes
        assert wait_for(lambda: p.poll_many(ROOMS)[ROOMS[3]] == KVPoll.WaitingForInput, 5.0)
        answers = p.poll_many(ROOMS)
        assert answers[ROOMS[3]] == KVPoll.WaitingForInput
        assert {answers[r] for r in ROOMS if r != ROOMS[3]} == {KVPoll.Bootstrapping}
        quiet_step(p, ROOMS)
        # the decode side waits too; the sender's transfer (finish.lua) notifies it
        d.init_many({r: np.arange(4) for r in ROOMS if r != ROOMS[3]})
        quiet_step(d, ROOMS)
        p.poll_many(ROOMS)  # every sender saw its receiver's infos
        assert p.begin_many(ROOMS[:2]) == dict.fromkeys(ROOMS[:2], KVPoll.Transferring)
        assert p.finish_many(ROOMS[:2]) == dict.fromkeys(ROOMS[:2], KVPoll.Success)
        assert wait_for(
            lambda: [d.poll_many(ROOMS)[r] for r in ROOMS[:2]] == [KVPoll.Success] * 2, 5.0
        )
        assert {d.poll_many(ROOMS)[r] for r in ROOMS[2:]} == {KVPoll.WaitingForInput}
        # an abort from the prefill side fails the decode's room: mark_room notifies
        p.sender(ROOMS[5]).abort("notice test")
        assert wait_for(lambda: d.poll_many(ROOMS)[ROOMS[5]] == KVPoll.Failed, 5.0)
        p.clear_many(ROOMS)
        d.clear_many(ROOMS)


def test_lost_notices_poll_everything_after_a_resubscribe(
    redis_url: str, redis_proc: RedisProcess, only_redis: None
) -> None:
    """A killed subscription loses what was published meanwhile: redis-py subscribes
    again and its confirmation makes the next step poll every room."""
    store = kvstate.connect(redis_url, namespace=NAMESPACE, options=OPTIONS)
    admin = redis_proc.client()
    p, d = managers(store, lease=60.0)
    try:
        with p, d:
            for r in ROOMS:
                p.sender(r)
                d.receiver(r, PREFILL_ADDR)
            p.poll_many(ROOMS)
            quiet_step(p, ROOMS)
            # both managers' (and any feed a test before this one closed: a closed
            # feed's reader drops its subscription within 0.25 s)
            assert admin.client_kill_filter(_type="pubsub") >= 2
            d.init_many({ROOMS[0]: np.arange(4)})  # its notice reaches nobody
            assert wait_for(lambda: p.poll_many(ROOMS)[ROOMS[0]] == KVPoll.WaitingForInput, 5.0)
            quiet_step(p, ROOMS)  # subscribed again: waiting steps are free again
            d.init_many({ROOMS[1]: np.arange(4)})  # and notices reach it
            assert wait_for(lambda: p.poll_many(ROOMS)[ROOMS[1]] == KVPoll.WaitingForInput, 5.0)
            p.clear_many(ROOMS)
            d.clear_many(ROOMS)
    finally:
        store.close()


@pytest.fixture
def sweeping(redis_url: str) -> Iterator[Store]:
    store = kvstate.connect(
        redis_url, namespace=NAMESPACE, options=kvstate.Options(notice_sweep=0.3)
    )
    yield store
    store.close()


def test_timeouts_fire_within_the_sweep(sweeping: Store) -> None:
    """Nobody publishes: no notice ever comes, and the sweep polls the room in time for
    poll.lua to fail it; the decode side learns it from the failure's notice."""
    p = kvstate.KVManager(sweeping, "prefill", "prefill-a.tp0", PREFILL_ADDR, bootstrap_timeout=0.5)
    d = kvstate.KVManager(sweeping, "decode", "decode-b.tp0", "10.0.0.2:8998")
    with p, d:
        snd = p.sender(ROOMS[0])
        rcv = d.receiver(ROOMS[0], PREFILL_ADDR)
        rcv.poll()  # bound (no pages yet): it waits for its sender
        assert p.poll_many(ROOMS[:1]) == {ROOMS[0]: KVPoll.Bootstrapping}
        assert d.poll_many(ROOMS[:1]) == {ROOMS[0]: KVPoll.Bootstrapping}
        assert wait_for(lambda: p.poll_many(ROOMS[:1])[ROOMS[0]] == KVPoll.Failed, 3.0)
        assert "bootstrap timeout" in snd.reason
        assert wait_for(lambda: d.poll_many(ROOMS[:1])[ROOMS[0]] == KVPoll.Failed, 3.0)
        p.clear_many(ROOMS[:1])
        d.clear_many(ROOMS[:1])


def test_notify_names_the_channel_keys_spells(redis_url: str) -> None:
    """_lib.lua's notify builds the channel from a participant's key: it must be
    Keys.changed's (an engine name with the characters names may hold)."""
    engine = "decode-[b]:1.tp0@x/y"
    store = kvstate.connect(redis_url, namespace=NAMESPACE)
    sub = redis.Redis(unix_socket_path=redis_url[len("unix://") :]).pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(Keys(NAMESPACE).changed(engine))
    try:
        assert wait_for(lambda: sub.get_message(timeout=0.05) is not None, 5.0)  # subscribed
        d = kvstate.KVManager(store, "decode", engine, "10.0.0.2:8998")
        with d:
            d.receiver(ROOMS[0], PREFILL_ADDR).poll()  # a member of the room
            store.abort(ROOMS[0], "channel test")
            rooms: list[bytes] = []
            deadline = time.monotonic() + scaled(5.0)
            while str(ROOMS[0]).encode() not in rooms and time.monotonic() < deadline:
                msg = sub.get_message(timeout=0.05)
                if msg and msg["type"] == "message":
                    rooms.append(msg["data"])
            assert rooms == [str(ROOMS[0]).encode()]
            d.clear_many(ROOMS[:1])
    finally:
        sub.close()
        store.close()


def test_close_drops_the_subscription(redis_url: str, redis_proc: RedisProcess) -> None:
    """The feed's reader closes its subscription within its read timeout of a close
    (no wait in close), and with notices off none is made."""
    store = kvstate.connect(redis_url, namespace=NAMESPACE)
    admin = redis_proc.client()

    def subscribers(engine: str) -> int:
        return int(
            dict(admin.pubsub_numsub(Keys(NAMESPACE).changed(engine)))[
                Keys(NAMESPACE).changed(engine).encode()
            ]
        )

    try:
        mgr = kvstate.KVManager(store, "decode", "decode-c.tp0", "10.0.0.2:8998")
        assert subscribers("decode-c.tp0") == 1
        mgr.close()
        assert wait_for(lambda: subscribers("decode-c.tp0") == 0, 5.0)
        off = kvstate.connect(
            redis_url, namespace=NAMESPACE, options=kvstate.Options(notices=False)
        )
        with kvstate.KVManager(off, "decode", "decode-d.tp0", "10.0.0.2:8998") as m:
            m.poll_many([])
            assert subscribers("decode-d.tp0") == 0
        off.close()
    finally:
        store.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"notice_sweep": 0},
        {"notice_sweep": -1.0},
        {"notice_sweep": True},
        {"notice_sweep": "1"},
        {"notice_sweep": 7200},
        {"notices": "yes"},
        {"notices": 1},
    ],
)
def test_notice_options_are_checked(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidOptionError):
        kvstate.Options(**kw)  # type: ignore[arg-type]


def test_a_step_right_after_a_call_in_this_process_sees_it(store: Store) -> None:
    """Both sides in one process, one after the other (a test, the demo, a benchmark):
    the finish's PUBLISH may reach the decode's subscription after the prefill has its
    reply, so the process tells its own feeds at once (``told_here``)."""
    p, d = managers(store, lease=60.0)
    with p, d:
        for n in range(8):
            rooms = [1000 + 16 * n + i for i in range(16)]
            for r in rooms:
                d.receiver(r, PREFILL_ADDR)
                p.sender(r)
            d.poll_many(rooms)
            d.init_many(dict.fromkeys(rooms, np.arange(4)))
            assert set(p.poll_many(rooms).values()) == {KVPoll.WaitingForInput}
            assert set(d.poll_many(rooms).values()) == {KVPoll.WaitingForInput}
            p.begin_many(rooms)
            p.finish_many(rooms)
            assert set(d.poll_many(rooms).values()) == {KVPoll.Success}
            p.clear_many(rooms)
            d.clear_many(rooms)


def test_any_doubt_polls_everything(redis_url: str, redis_proc: RedisProcess) -> None:
    """A feed that cannot subscribe, a notice that names no room, a closed feed: each
    drain answers EVERYTHING (poll every room), never raises."""
    dead = notices.ChangeFeed(redis.Redis(host="127.0.0.1", port=1), Keys(NAMESPACE), "e")
    assert dead.drain() is notices.EVERYTHING
    dead.close()
    store = kvstate.connect(redis_url, namespace=NAMESPACE)
    feed = store.changes("decode-e.tp0")
    try:
        assert wait_for(lambda: feed.drain() == set(), 5.0)  # confirmed, nothing since
        admin = redis_proc.client()
        admin.publish(Keys(NAMESPACE).changed("decode-e.tp0"), "42")
        assert wait_for(lambda: feed.drain() == {42}, 5.0)
        admin.publish(Keys(NAMESPACE).changed("decode-e.tp0"), "not a room")
        assert wait_for(lambda: feed.drain() is notices.EVERYTHING, 5.0)
        feed.close()
        assert feed.drain() is notices.EVERYTHING
    finally:
        feed.close()
        store.close()


@pytest.mark.slow
@pytest.mark.cluster
def test_a_node_lost_is_met_by_the_sweep(tmp_path: Path) -> None:
    """Notices on, one primary black-holed: the waiting rooms are answered from their
    last status until the sweep polls them, which lists the bad node's rooms in
    ``.errors`` (test_bounded's partial results, a sweep later)."""
    pc = ProxiedCluster(tmp_path)
    opts = kvstate.Options(notice_sweep=0.5, call_timeout=2.0)
    store = kvstate.connect(pc.url, namespace="partial", options=opts)
    try:
        p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=30.0)
        d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1", lease=30.0)
        with p, d:
            rooms, bad = waiting_rooms(pc, store, p, d, 30)
            pc.proxy.blackhole()
            assert wait_for(lambda: set(p.poll_many(rooms).errors) == bad, 10.0)
            pc.proxy.passthrough()
            assert wait_for(lambda: not p.poll_many(rooms).errors, 20.0)
    finally:
        store.close()
        pc.close()


def changed(mgr: kvstate.KVManager, until: int, timeout: float = 5.0) -> dict[int, KVPoll]:
    """poll_changed's answers, gathered step by step until one names ``until``."""
    seen: dict[int, KVPoll] = {}
    assert wait_for(lambda: seen.update(mgr.poll_changed()) or until in seen, timeout), seen
    return seen


def test_poll_changed_answers_only_the_rooms_that_moved(
    store: Store, only_redis: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a connector's step acts on (issue 33 target 3): a waiting step answers no
    room and makes no round trip; a room another engine changed, a new one and one that
    is not waiting (it concluded, not cleared yet) are answered, nothing else."""
    p, d = managers(store, lease=60.0)
    with p, d:
        for r in ROOMS:
            p.sender(r)
            d.receiver(r, PREFILL_ADDR)
        first = p.poll_changed()  # never answered: every room
        assert first == dict.fromkeys(ROOMS, KVPoll.Bootstrapping)
        assert wait_for(lambda: not p.poll_changed(), 5.0)  # subscription confirmed
        looked: list[int] = []  # a quiet step looks up no room: its cost is not theirs
        get = p._parts.get
        monkeypatch.setattr(p._parts, "get", lambda room: looked.append(room) or get(room))
        with RoundTrips.installed() as rt:
            before = rt.count
            for _ in range(3):
                assert p.poll_changed() == {}
            assert rt.count == before
        assert looked == []
        # what a step may skip on (the vLLM worker starts no run): nothing due, no
        # round trip, and a notice read here stays for the poll that answers it
        assert p.nothing_due()
        assert d.init_many({ROOMS[3]: np.arange(4)})[ROOMS[3]] == KVPoll.WaitingForInput
        assert wait_for(lambda: not p.nothing_due(), 5.0)
        assert not p.nothing_due()
        assert changed(p, ROOMS[3]) == {ROOMS[3]: KVPoll.WaitingForInput}
        assert p.poll_changed() == {}
        assert p.nothing_due()
        assert p.begin_many(ROOMS[3:4]) == {ROOMS[3]: KVPoll.Transferring}
        assert p.finish_many(ROOMS[3:4]) == {ROOMS[3]: KVPoll.Success}
        # Success is not waiting: answered every step until cleared
        assert p.poll_changed() == {ROOMS[3]: KVPoll.Success}
        assert p.poll_changed() == {ROOMS[3]: KVPoll.Success}
        p.clear_many(ROOMS[3:4])
        assert p.poll_changed() == {}
        seen = changed(d, ROOMS[3])  # the decode's first step answers every new room
        assert seen[ROOMS[3]] == KVPoll.Success
        d.clear_many(ROOMS[3:4])
        assert wait_for(lambda: not d.poll_changed(), 5.0)
        p.sender(500)
        assert not p.nothing_due()  # a new room is due
        assert p.poll_changed() == {500: KVPoll.Bootstrapping}
        assert p.poll_changed() == {}
        assert p.nothing_due()
        p.clear_many([500], later=True)
        assert not p.nothing_due()  # a clear rides the next batch
        assert p.poll_changed() == {} and p.nothing_due()
        p.sender(500)
        assert p.poll_changed() == {500: KVPoll.Bootstrapping}
        p.sender(ROOMS[5]).abort("notice test")  # the decode's room fails: it is told
        assert changed(d, ROOMS[5]) == {ROOMS[5]: KVPoll.Failed}
        p.clear_many([*ROOMS, 500])
        d.clear_many(ROOMS)
        assert p.poll_changed() == {} and d.poll_changed() == {}


def test_poll_changed_sweeps_and_asks_again(redis_url: str, redis_proc: RedisProcess) -> None:
    """No notice comes for a timeout: the sweep answers every waiting room; a
    resubscribe (notices lost) answers every room."""
    store = kvstate.connect(
        redis_url, namespace=NAMESPACE, options=kvstate.Options(notice_sweep=0.3)
    )
    admin = redis_proc.client()
    p = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, bootstrap_timeout=0.6)
    try:
        with p:
            p.sender(ROOMS[0])
            p.sender(ROOMS[1])
            assert wait_for(lambda: not p.poll_changed(), 5.0)
            assert wait_for(lambda: not p.nothing_due(), 3.0)  # the sweep came
            # swept: answered again (Bootstrapping) until poll.lua fails them
            seen: dict[int, KVPoll] = {}
            assert wait_for(
                lambda: seen.update(p.poll_changed()) or seen.get(ROOMS[0]) == KVPoll.Failed,
                3.0,
            )
            p.clear_many(ROOMS[:2])
            p.sender(ROOMS[2])
            assert wait_for(lambda: not p.poll_changed(), 5.0)
            assert admin.client_kill_filter(_type="pubsub") >= 1  # as above
            assert wait_for(lambda: not p.nothing_due(), 5.0)  # notices may be lost
            assert changed(p, ROOMS[2]) == {ROOMS[2]: KVPoll.Bootstrapping}
            p.clear_many(ROOMS[2:3])
    finally:
        store.close()


def test_a_clear_on_another_thread_meets_a_step(store: Store, only_redis: None) -> None:
    """A participant's clear (which forgets its room) may run on another thread than
    the step, whose ``poll_changed`` walks the answers due for the sweep: neither may
    see the other's bookkeeping half done (thread switches forced often; the step's
    walk alone, without its round trip, so that they meet)."""
    p = kvstate.KVManager(store, "prefill", "prefill-t.tp0", PREFILL_ADDR, lease=60.0)
    errors: list[BaseException] = []
    done = threading.Event()

    def churn() -> None:
        try:
            for n in range(200):
                snd = p.sender(5000 + n)
                p.poll_many([snd.room])  # answered: in the sweep's order
                snd.clear()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            done.set()

    switch = sys.getswitchinterval()
    with p:
        p.poll_many([p.sender(r).room for r in range(2000, 2400)])
        p.notices.sweep = 0.0  # every answered room is due: each walk meets them all
        sys.setswitchinterval(1e-6)
        try:
            worker = threading.Thread(target=churn)
            worker.start()
            walks = 0
            while not done.is_set():
                p.notices.due()
                walks += 1
            worker.join()
        finally:
            sys.setswitchinterval(switch)
        assert errors == [] and walks > 0
        p.clear_many(range(2000, 2400))
