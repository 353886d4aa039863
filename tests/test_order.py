"""One room, one outcome, in any call order (issue 17): the orders a serving scheduler
produces, on real Redis, standalone and a 3-primary Cluster.

- once any participant of a room is Failed (abort, fan-out, timeout, fail_peer, a lost
  lease) no participant of it reaches Success, and at rest they agree;
- an abort (any failure) reaches participants created after it, even after the other
  side cleared: the room's failure mark outlives clear();
- no Transferring or Success before every required receiver bound and published, and
  no finish without begin;
- a closed KVManager, its participants and a closed Store refuse every call;
- a corrupt room fails alone in a batch;
- a refused call writes nothing (design rule 7).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll, schema
from kvstate.errors import (
    ClosedError,
    CorruptStateError,
    InvalidValueError,
    KVStateError,
    ManagerClosedError,
    NotReadyError,
)
from kvstate.ops import reads
from kvstate.store import MARK_MIN_TTL, Store, command_call
from tests.helpers import (
    PREFILL_ADDR,
    keys_of,
    managers,
    room_keys,
    scaled,
    snapshot,
    wait_for,
)

NAMESPACE = "order"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # every key, failure marks included


def ready_room(
    p: kvstate.KVManager, d: kvstate.KVManager, room: int
) -> tuple[kvstate.KVSender, kvstate.KVReceiver]:
    snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
    assert rcv.init(np.arange(8)) == KVPoll.WaitingForInput
    assert snd.poll() == KVPoll.WaitingForInput
    return snd, rcv


def mark_of(store: Store, room: int) -> tuple[str | None, int]:
    mark, pttl = store.execute(reads.mark_of(store.keys, room))
    return (None if mark is None else mark[0]), int(pttl)


def agree(*parts: kvstate.KVSender | kvstate.KVReceiver) -> set[KVPoll]:
    """The statuses the participants read now (at rest, one outcome: one status)."""
    return {p.poll() for p in parts}


# ----------------------------------------------------------------- 1. one outcome


def test_fail_peer_between_begin_and_finish_fails_the_sender(store: Store) -> None:
    """The one-process form of the split brain: the decode's fan-out fails the room
    while the sender is Transferring; finish_transfer() answers Failed, never Success."""
    p, d = managers(store)
    with p, d:
        snd, rcv = ready_room(p, d, 1)
        assert snd.begin_transfer() == KVPoll.Transferring
        assert d.fail_peer(PREFILL_ADDR, "peer prefill-a.tp0 lost its lease") == 1
        assert snd.finish_transfer() == KVPoll.Failed
        assert "lost its lease" in snd.reason
        assert agree(snd, rcv) == {KVPoll.Failed}
        assert snd.begin_transfer() == KVPoll.Failed  # sticky, nothing written
        # send() answers the same (it needs a transport; the status says it first)
        assert mark_of(store, 1)[0] == "peer prefill-a.tp0 lost its lease"


def test_a_process_past_its_lease_cannot_write_success(store: Store) -> None:
    """A prefill whose lease lapsed (stopped, or cut off from Redis, longer than its
    lease) resumes: finish_transfer() fails the room instead of writing Success, both
    when its peer noticed (the decode's heartbeat failed the receivers) and when it
    did not yet (the prefill's own lease check)."""
    lease = 1.0
    p = kvstate.KVManager(store, "prefill", "p-lapse", PREFILL_ADDR, lease=lease)
    d = kvstate.KVManager(store, "decode", "d-lapse", "10.0.0.2:1", heartbeat_interval=0.1)
    with p, d:
        # peer noticed: the prefill's heartbeat stops (a SIGSTOP of the process as
        # far as Redis can tell); the decode fails the receivers bound to it
        snd, rcv = ready_room(p, d, 2)
        assert snd.begin_transfer() == KVPoll.Transferring
        p.heartbeat.stop()
        assert wait_for(lambda: rcv.poll() == KVPoll.Failed, 10 * lease)
        assert "lost its lease" in rcv.reason
        assert snd.finish_transfer() == KVPoll.Failed
        assert "lost its lease" in snd.reason
        assert agree(snd, rcv) == {KVPoll.Failed}
    p = kvstate.KVManager(store, "prefill", "p-lapse2", PREFILL_ADDR, lease=lease)
    d = kvstate.KVManager(store, "decode", "d-lapse2", "10.0.0.2:2", heartbeat_interval=60)
    with p, d:
        # peer did not notice (its heartbeat is slow): the local check refuses
        snd = p.sender(3)
        rcv = d.receiver(3, PREFILL_ADDR, senders=["p-lapse2"])
        rcv.init([1, 2])
        assert snd.poll() == KVPoll.WaitingForInput
        assert snd.begin_transfer() == KVPoll.Transferring
        p.heartbeat.stop()
        time.sleep(lease * 1.2)
        assert snd.finish_transfer() == KVPoll.Failed
        assert "p-lapse2 lost its lease" in snd.reason and "lapsed" in snd.reason
        assert rcv.poll() == KVPoll.Failed and "p-lapse2 lost its lease" in rcv.reason


@pytest.mark.parametrize("how", ["abort", "fail", "timeout", "fail_peer"])
def test_no_success_once_any_participant_failed(store: Store, how: str) -> None:
    """Every way a participant fails, then every way the sender could reach Success:
    begin, finish and send answer Failed with the recorded reason; at rest both agree."""
    p, d = managers(store, waiting_timeout=0.5 if how == "timeout" else 300.0)
    with p, d:
        snd, rcv = ready_room(p, d, 4)
        reason = {
            "abort": "client went away",
            "fail": "decode ran out of pages",
            "timeout": "waiting timeout",
            "fail_peer": "peer gone",
        }[how]
        if how == "abort":
            rcv.abort(reason)
        elif how == "fail":
            rcv.fail(reason)
        elif how == "timeout":
            assert wait_for(lambda: rcv.poll() == KVPoll.Failed, 5)
        else:
            d.fail_peer(PREFILL_ADDR, reason)
        assert rcv.poll() == KVPoll.Failed and reason in rcv.reason
        assert snd.begin_transfer() == KVPoll.Failed and reason in snd.reason
        assert snd.finish_transfer() == KVPoll.Failed and reason in snd.reason
        assert agree(snd, rcv) == {KVPoll.Failed}


def test_a_room_failing_after_one_sender_succeeded_fails_it_too(store: Store) -> None:
    """Two senders, one receiver: the first sender finished, the second's receiver side
    fails. At rest every participant reads Failed (the mark fails a Success too)."""
    p1 = kvstate.KVManager(store, "prefill", "p1", PREFILL_ADDR, ranks=2)
    p2 = kvstate.KVManager(store, "prefill", "p2", PREFILL_ADDR, ranks=2)
    d = kvstate.KVManager(store, "decode", "d1", "10.0.0.2:1")
    with p1, p2, d:
        s1, s2, rcv = p1.sender(5), p2.sender(5), d.receiver(5, PREFILL_ADDR)
        assert rcv.init([1, 2]) == KVPoll.WaitingForInput
        for s in (s1, s2):
            assert s.poll() == KVPoll.WaitingForInput
            assert s.begin_transfer() == KVPoll.Transferring
        assert s1.finish_transfer() == KVPoll.Success
        s2.abort("prefill rank 2 died")
        assert agree(s1, s2, rcv) == {KVPoll.Failed}
        assert s1.finish_transfer() == KVPoll.Failed  # a retried finish says so too


def test_abort_after_success_fails_both_sides(store: Store) -> None:
    """What an abort after Success means: the room's result is not to be used. Before
    a side cleared, both read Failed with the reason; a side that already cleared had
    acted on Success (its pages freed), which no longer matters to anyone."""
    p, d = managers(store)
    with p, d:
        snd, rcv = ready_room(p, d, 6)
        snd.begin_transfer()
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        rcv.abort("client went away after the transfer")
        assert agree(snd, rcv) == {KVPoll.Failed}
        assert "client went away" in snd.reason
        snd.clear()
        rcv.clear()
        snd, rcv = ready_room(p, d, 7)
        snd.begin_transfer()
        snd.finish_transfer()
        snd.clear()  # the prefill is done with it
        rcv.abort("too late")
        assert rcv.poll() == KVPoll.Failed
        rcv.clear()
        assert room_keys(store, 7) == []


# --------------------------------------------------------- 2. abort reaches late joiners


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_abort_reaches_a_participant_created_after_the_other_side_cleared(
    store: Store, first: str
) -> None:
    """init, abort, clear on one side; the other side joins afterwards: its first poll
    is Failed with the abort's reason (not a bootstrap timeout 300 s later)."""
    p, d = managers(store)
    with p, d:
        if first == "decode":
            early: kvstate.KVSender | kvstate.KVReceiver = d.receiver(8, PREFILL_ADDR)
            early.init([1, 2, 3])  # type: ignore[union-attr]
        else:
            early = p.sender(8)
            early.poll()
        early.abort("client went away")
        early.clear()
        assert room_keys(store, 8) == []  # no participant state left behind
        reason, pttl = mark_of(store, 8)
        assert reason and "client went away" in reason
        assert pttl > (MARK_MIN_TTL - 60) * 1000  # outlives the bootstrap timeout
        late = p.sender(8) if first == "decode" else d.receiver(8, PREFILL_ADDR)
        assert late.poll() == KVPoll.Failed
        assert "client went away" in late.reason
        exc = late.failure_exception()
        assert exc is not None and "client went away" in exc.reason
        assert room_keys(store, 8) == []
        assert room_keys(store, 8, marks=True) == [store.keys.aborted(8)]


def test_a_timeout_reaches_the_other_side(store: Store) -> None:
    """A receiver that times out (its prefill never came) fails the room: the sender
    that joins or polls later reads the same reason; the forgotten init() is named."""
    p = kvstate.KVManager(store, "prefill", "p-to", PREFILL_ADDR, bootstrap_timeout=0)
    d = kvstate.KVManager(store, "decode", "d-to", "10.0.0.2:3", bootstrap_timeout=0.3)
    with p, d:
        rcv = d.receiver(9, PREFILL_ADDR)
        rcv.poll()  # bound to p-to, never init(): Bootstrapping
        assert rcv.senders == ["p-to"]
        snd = p.sender(9)
        assert snd.poll() == KVPoll.Bootstrapping
        assert wait_for(lambda: rcv.poll() == KVPoll.Failed, 5)
        assert "bootstrap timeout" in rcv.reason and "init() was never called" in rcv.reason
        assert snd.poll() == KVPoll.Failed and snd.reason == rcv.reason


# -------------------------------------------------------------- 3. not before binding


def test_begin_and_finish_refuse_before_binding(store: Store) -> None:
    """begin/finish on a sender no receiver has published to raise NotReadyError and
    write nothing; finish before begin too. A receiver that joins later is served."""
    p, d = managers(store)
    with p, d:
        snd = p.sender(10, required_receivers=2)
        snd.poll()
        before = snapshot(store)
        with pytest.raises(NotReadyError, match="WaitingForInput"):
            snd.begin_transfer()
        with pytest.raises(NotReadyError, match="begin_transfer"):
            snd.finish_transfer()
        assert snapshot(store) == before
        # one of two receivers published: still not ready
        r1 = d.receiver(10, PREFILL_ADDR, senders=[p.engine])
        r1.init([1])
        assert snd.poll() == KVPoll.Bootstrapping
        before = snapshot(store)
        with pytest.raises(NotReadyError):
            snd.begin_transfer()
        assert snapshot(store) == before
        d2 = kvstate.KVManager(store, "decode", "decode-c.tp0", "10.0.0.3:1")
        with d2:
            r2 = d2.receiver(10, PREFILL_ADDR, senders=[p.engine])
            r2.init([2])
            assert snd.poll() == KVPoll.WaitingForInput
            before = snapshot(store)
            with pytest.raises(NotReadyError, match="begin_transfer"):
                snd.finish_transfer()  # without begin
            assert snapshot(store) == before
            assert snd.begin_transfer() == KVPoll.Transferring
            assert snd.finish_transfer() == KVPoll.Success
            assert agree(snd, r1, r2) == {KVPoll.Success}
            r2.clear()


def test_batches_refuse_rooms_not_ready(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        ready, early = ready_room(p, d, 11)[0], p.sender(12)
        early.poll()
        out = p.finish_many([11, 12])  # neither begun
        assert not out and set(out.errors) == {11, 12}
        assert all(isinstance(e, NotReadyError) for e in out.errors.values())
        out = p.begin_many([11, 12])
        assert out == {11: KVPoll.Transferring} and isinstance(out.errors[12], NotReadyError)
        assert p.finish_many([11]) == {11: KVPoll.Success}
        assert ready.status == KVPoll.Success


def test_a_step_run_behind_runs_its_calls_and_holds_the_callers(store: Store) -> None:
    """``run_behind``: a step's calls run on the manager's thread while the caller goes
    on; a call inside the step runs at once (``wait=False`` too), a call from the
    caller's thread waits for the step to end (never two calls at once on one rank),
    and what the step raised is its Future's, the manager usable after."""
    p, d = managers(store)
    gate = threading.Event()
    ran: list[str] = []

    def step() -> int:
        snd = p.sender(31)  # inside: does not wait for itself
        snd.poll()  # its create, a round trip on the thread behind
        assert p.clear_many([], wait=False).done()  # a call behind from here: at once
        gate.wait(scaled(10))
        ran.append("step")
        return snd.room

    run = p.run_behind(step)
    assert not run.done()  # held at the gate: the caller went on
    threading.Timer(0.1, gate.set).start()
    assert p.poll_many([]) == {}  # the caller's call waits for the step first
    assert run.done() and ran == ["step"] and run.result() == 31
    failed = p.run_behind(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=scaled(10))
    assert p.poll_many([31]) == {31: KVPoll.Bootstrapping}
    p.clear_many([31])
    p.close()
    d.close()
    assert room_keys(store, 31) == []


# ------------------------------------------------------------------- 4. closed


def test_a_closed_manager_refuses_every_call(store: Store) -> None:
    p, d = managers(store)
    snd, rcv = ready_room(p, d, 13)
    p.close()
    d.close()
    calls: dict[str, Callable[[], object]] = {
        "sender": lambda: p.sender(14),
        "receiver": lambda: d.receiver(14, PREFILL_ADDR),
        "poll_many": lambda: p.poll_many([13]),
        "begin_many": lambda: p.begin_many([13]),
        "finish_many": lambda: p.finish_many([13]),
        "init_many": lambda: d.init_many({13: [1]}),
        "clear_many": lambda: p.clear_many([13]),
        "abort_many": lambda: p.abort_many({13: "x"}),
        "finish_many behind": lambda: p.finish_many([13], wait=False),
        "run_behind": lambda: p.run_behind(lambda: None),
        "fail_peer": lambda: d.fail_peer(PREFILL_ADDR, "x"),
        "poll": snd.poll,
        "rcv.poll": rcv.poll,
        "begin_transfer": snd.begin_transfer,
        "finish_transfer": snd.finish_transfer,
        "transfer_infos": snd.transfer_infos,
        "snd.init": lambda: snd.init(8),
        "rcv.init": lambda: rcv.init([1]),
        "fail": lambda: snd.fail("x"),
        "abort": lambda: rcv.abort("x"),
        "failure_exception": rcv.failure_exception,
        "clear": snd.clear,
        "send": lambda: snd.send([1]),
    }
    before = snapshot(store)
    for name, call in calls.items():
        with pytest.raises(ManagerClosedError, match="was closed") as info:
            call()
        assert isinstance(info.value, KVStateError) and isinstance(info.value, ClosedError), name
    assert {k: v for k, v in snapshot(store).items() if ":engine" not in k} == {
        k: v for k, v in before.items() if ":engine" not in k
    }
    p.close()  # idempotent
    # the participants' keys expire on their TTL (the closed manager cannot clear)
    spare = kvstate.KVManager(store, "prefill", "spare", "10.0.0.9:1")
    with spare:
        store.clear(13, "tx", p.engine)
        store.clear(13, "rx", d.engine, senders=[p.engine], peer_addr=PREFILL_ADDR)


def test_a_manager_cannot_be_made_on_a_closed_store(state_url: str) -> None:
    store = kvstate.connect(state_url, namespace="order-closed")
    spy = kvstate.connect(state_url, namespace="order-closed")
    store.close()
    with pytest.raises(ClosedError, match="was closed"):
        kvstate.KVManager(store, "prefill", "p-closed", PREFILL_ADDR)
    assert keys_of(spy) == []  # nothing registered
    spy.close()


# ------------------------------------------------------------ 5. a corrupt room alone


def test_a_corrupt_room_fails_alone_in_every_batch(store: Store) -> None:
    """A participant hash with a status no kvstate writes (another client's doing):
    poll_many, begin_many, finish_many and clear_many answer the 19 healthy rooms of
    the step and list the corrupt one in .errors (the prefill's begin reads the
    receiver: it fails there too)."""
    p, d = managers(store)
    rooms = list(range(100, 120))
    bad = 107
    with p, d:
        for r in rooms:
            p.sender(r)
            d.receiver(r, PREFILL_ADDR)
        assert set(d.init_many(dict.fromkeys(rooms, [1, 2])).values()) == {KVPoll.WaitingForInput}
        store.client.hset(store.keys.participant(bad, "rx", d.engine), "status", "Bogus")
        out = d.poll_many(rooms)
        assert set(out) == set(rooms) - {bad}
        assert set(out.errors) == {bad} and isinstance(out.errors[bad], CorruptStateError)
        assert "Bogus" in str(out.errors[bad])
        assert set(p.poll_many(rooms).values()) == {KVPoll.WaitingForInput}  # its own is fine
        begun = p.begin_many(rooms)
        assert set(begun.values()) == {KVPoll.Transferring} and set(begun.errors) == {bad}
        done = p.finish_many([r for r in rooms if r != bad])
        assert set(done.values()) == {KVPoll.Success}
        # the tracker of the address is another key: corrupt the room hash
        store.client.delete(store.keys.room_hash(bad))
        store.client.set(store.keys.room_hash(bad), "garbage", px=60_000)
        errors = d.clear_many(rooms)
        assert set(errors) == {bad} and isinstance(errors[bad], CorruptStateError)
        assert p.clear_many([r for r in rooms if r != bad]) == {}
        assert all(room_keys(store, r) == [] for r in rooms if r != bad)
        store.execute([command_call("DEL", *room_keys(store, bad))])
        p.clear_many([bad])


# ------------------------------------------------------------ 6. refused writes nothing


def test_finish_with_a_corrupt_receiver_writes_nothing(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = ready_room(p, d, 20)
        assert snd.begin_transfer() == KVPoll.Transferring
        store.client.hset(rcv.key, "peers", "many")
        before = snapshot(store)
        with pytest.raises(CorruptStateError, match="peers"):
            snd.finish_transfer()
        assert snapshot(store) == before  # the sender is not Success
        store.client.hset(rcv.key, "status", "Bogus")
        before = snapshot(store)
        with pytest.raises(CorruptStateError, match="Bogus"):
            snd.finish_transfer()
        assert snapshot(store) == before
        snd.abort("operator: corrupt receiver")  # the way out of a corrupt room
        assert snd.poll() == KVPoll.Failed
        assert store.client.hget(rcv.key, "status") == b"Failed"


def test_publish_with_a_corrupt_sender_writes_nothing(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(21)
        snd.poll()
        rcv = d.receiver(21, PREFILL_ADDR)
        rcv.poll()  # bound
        store.client.hset(snd.key, "peers", "x")
        before = snapshot(store)
        with pytest.raises(CorruptStateError, match="peers"):
            rcv.init([1, 2])
        after = snapshot(store)
        # the receiver records its own refusal (init() refused by Redis), nothing else
        assert {k: v for k, v in after.items() if k != rcv.key} == {
            k: v for k, v in before.items() if k != rcv.key
        }
        field = schema.xfer_field(p.engine, rcv.engine)
        assert store.client.hget(store.keys.room_hash(21), field) is None
        snd.abort("corrupt")


def test_a_corrupt_mark_is_named_and_abort_replaces_it(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        store.client.set(store.keys.aborted(22), "x")  # a mark is a hash
        store.client.pexpire(store.keys.aborted(22), 60_000)
        snd = p.sender(22)
        with pytest.raises(CorruptStateError, match="aborted"):
            snd.poll()
        assert room_keys(store, 22) == []  # nothing created
        store.abort(22, "operator")
        assert mark_of(store, 22)[0] == "operator"
        assert snd.poll() == KVPoll.Failed


# ------------------------------------------------------------------------ 11. odds


def test_value_errors_are_kvstate_errors(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        for call in (
            lambda: p.sender(1, required_receivers=0),
            lambda: d.receiver(1, PREFILL_ADDR, required_senders=0),
            lambda: d.receiver(1, PREFILL_ADDR, senders=[]),
            lambda: kvstate.KVManager(store, "router", "x"),
            lambda: kvstate.KVManager(store, "prefill", "x", ranks=0),
        ):
            with pytest.raises(InvalidValueError) as info:
                call()
            assert isinstance(info.value, ValueError) and isinstance(info.value, KVStateError)


def test_failure_exception_of_a_live_room_is_none(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = ready_room(p, d, 23)
        assert snd.failure_exception() is None  # not Failed: nothing to report
        assert rcv.failure_exception() is None
        assert room_keys(store, 23)  # and nothing cleared
        assert snd.begin_transfer() == KVPoll.Transferring
        snd.clear()
        rcv.clear()


def test_the_audit_does_not_report_failure_marks(store: Store) -> None:
    """A cleared room's failure mark is intended state with a TTL, not a leak."""
    from kvstate.ops.audit import Auditor

    p, d = managers(store)
    with p, d:
        snd, rcv = ready_room(p, d, 30)
        rcv.abort("client went away")
        snd.clear()
        rcv.clear()
        assert room_keys(store, 30, marks=True) == [store.keys.aborted(30)]
        report = Auditor(store, grace=0.0).run()
        assert report.findings == [], report.findings
