"""The connector's batched step on vLLM 0.34's own Scheduler, its worker side in this
process (``tools/bench/steps``' engine, as the benchmark runs it; the rig's worker
processes elsewhere): a step's hooks make no round trip, its work runs behind it (each
step here waits for that run, as a GPU forward outlasts it); the rooms a run pushes are
begun by its poll and take one ``finish_many`` whatever their number, and a
``finish_many`` that does not reach Redis is made by the next run, the rooms concluding
as usual (the prefill's Redis behind a proxy that drops it between two round trips of
one run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstate.roles.participant import Participant
from kvstate.testing import RedisProcess, RoundTrips
from tests.integrations.vllm_engine import keys_left, room_keys
from tests.proxy import Proxy

pytestmark = pytest.mark.vllm
LONG_LEASE = (("lease", 600.0),)  # no heartbeat crosses the proxy during a step


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[str, Proxy, Any]]:
    from tools.bench.steps.engine import write_model

    with (
        RedisProcess(tmp_path / "r", port="auto") as server,
        Proxy(("127.0.0.1", server.port)) as proxy,
        RoundTrips.installed(),
    ):
        yield server.url, proxy, write_model(tmp_path / "model")


def engines(url: str, prefill_url: str, model: str, name: str) -> tuple[Any, Any]:
    from tools.bench.steps.engine import Engine, Spec

    p = Engine(
        Spec("kv_producer", f"{name}-p", "KVStateConnector", prefill_url, model, 8, LONG_LEASE)
    )
    d = Engine(Spec("kv_consumer", f"{name}-d", "KVStateConnector", url, model, 8, LONG_LEASE))
    p.wait_behind = d.wait_behind = True  # each step's runs behind end within it
    return p, d


def prefilled(p: Any, rids: list[str]) -> None:
    """The prefill finishes ``rids``: their rooms made, held for a decode."""
    for rid in rids:
        p.add(rid, 1, {"do_remote_decode": True})
    for _ in range(10):
        if all(r in p.params for r in rids):
            break
        p.step()


def handed_over(p: Any, d: Any, rids: list[str]) -> None:
    """The prefill finishes ``rids`` and makes their rooms (no decode yet: they wait),
    the decode publishes into them."""
    prefilled(p, rids)
    made = p.step()  # the senders made, their rooms created in one round trip behind
    assert (made.trips, made.behind) == (0, 1), made
    for rid in rids:
        d.add(rid, 2, p.params[rid])
    for _ in range(2):
        d.step()


@pytest.mark.parametrize("n", [1, 8])
def test_a_waiting_step_looks_at_no_room(
    rig: tuple[str, Proxy, Any], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill holds rooms nobody changes: once each was answered, a step starts no
    run behind it, reads no room's status and makes no round trip, whatever their
    number (the worker runs only when ``nothing_due`` says a room may have moved, and
    looks at what ``poll_changed`` answers and what it acted on itself, not at every
    room in flight). Of a few steps one may meet the 1 s sweep, which polls them all."""
    url, _, model = rig
    p, d = engines(url, url, model, f"wait{n}")
    try:
        prefilled(p, [f"w{i}" for i in range(n)])
        for _ in range(20):  # the subscription confirmed, every room answered once
            if not p.step().behind:
                break
        reads: list[int] = []
        status = Participant.status
        assert status.fget is not None
        counting = property(lambda part: reads.append(part.room) or status.fget(part))
        monkeypatch.setattr(Participant, "status", counting)
        mgr = p.worker.worker.mgr
        runs: list[object] = []  # the runs behind the steps started
        run_behind = mgr.run_behind
        monkeypatch.setattr(mgr, "run_behind", lambda step: runs.append(step) or run_behind(step))
        looked = []
        for _ in range(5):
            reads.clear()
            runs.clear()
            step = p.step()
            assert step.trips == 0  # the hooks never make one
            looked.append((step.behind, len(reads), len(runs)))
        assert (0, 0, 0) in looked, looked
    finally:
        p.close()
        d.close()


def settle(p: Any, d: Any, rids: list[str]) -> None:
    for _ in range(50):
        if all(r in d.finished for r in rids) and not any(
            r in e.scheduler.requests for e in (p, d) for r in rids
        ):
            return
        p.step()
        d.step()
    raise AssertionError(f"not settled: {[r for r in rids if r not in d.finished]}")


@pytest.mark.parametrize("n", [1, 4])
def test_a_push_step_makes_the_same_round_trips_for_one_room_and_for_four(
    rig: tuple[str, Proxy, Any], n: int
) -> None:
    """The run that pushes makes the same round trips whatever the number of rooms: its
    poll, which begins them, and one ``finish_many``, which clears them
    (``clear=True``); the next step reports them sent without a trip while a room no
    decode took yet waits. The steps' hooks make none."""
    url, _, model = rig
    p, d = engines(url, url, model, f"flat{n}")
    try:
        rids = [f"r{i}" for i in range(n)]
        prefilled(p, ["held"])
        handed_over(p, d, rids)
        # poll_changed, which begins the rooms, the decode engine's registration (read
        # once per engine incarnation: this is the first write to it), finish_many
        push = p.step()
        assert (push.hook_trips, push.trips, push.behind) == ({}, 0, 3), push
        nxt = p.step()  # "held" waits; the pushed rooms are reported sent
        assert (nxt.trips, nxt.behind) == (0, 0), nxt
        assert all(r not in p.scheduler.requests for r in rids)
        # cleared with their finish: "held"'s sender is the one left
        assert len([k for k in room_keys(url) if ":tx:" in k]) == 1
        # a second push to the same decode engine: its registration is known
        handed_over(p, d, ["again"])
        again = p.step()
        assert (again.trips, again.behind) == (0, 2), again
        rids.append("again")
        d.add("held", 2, p.params["held"])
        rids.append("held")
        settle(p, d, rids)
        assert keys_left(url) == []
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize(
    "through",
    [0, 1, 2],
    ids=["lost-at-poll", "lost-at-push", "lost-at-finish"],
)
def test_redis_lost_mid_step_the_rooms_conclude_on_later_steps(
    rig: tuple[str, Proxy, Any], through: int
) -> None:
    """The prefill's Redis drops after ``through`` requests of a push run (its
    poll_changed, which begins the rooms, the receivers' registration read the first
    push makes, finish_many with the rooms' clears): the next runs take each room up
    where it stopped, the decode gets its KV, no key is left and nothing waits for a
    timeout."""
    url, proxy, model = rig
    p, d = engines(url, proxy.url(), model, f"lost{through}")
    try:
        rids = ["a", "b"]
        handed_over(p, d, rids)
        proxy.drop_after(through)
        step = p.step()
        assert step.trips == 0 and step.behind > through, step
        proxy.passthrough()
        settle(p, d, rids)
        assert keys_left(url) == []
    finally:
        p.close()
        d.close()


def test_a_stalled_redis_never_stalls_a_step(rig: tuple[str, Proxy, Any]) -> None:
    """The prefill's Redis stops answering while a push is due: its steps go on at once
    (their hooks never wait for the run behind them, which waits for Redis within its
    own deadline), nothing is reported sent while the run is held; once Redis answers
    again the rooms conclude, the decode gets its KV and no key is left."""
    url, proxy, model = rig
    p, d = engines(url, proxy.url(), model, "stall")
    try:
        rids = ["s0", "s1"]
        handed_over(p, d, rids)
        p.wait_behind = False  # steps as fast as the scheduler makes them
        proxy.stall()
        side = p.worker.worker
        runs = []
        for _ in range(5):
            step = p.step()
            assert step.trips == 0 and step.hook_trips == {}, step
            runs.append(side._run)
        assert all(r in p.scheduler.requests for r in rids)  # held: nothing reported
        # one run, started by the first step and still waiting for Redis: the others
        # neither waited for it nor started another
        assert runs[0] is not None and all(r is runs[0] for r in runs), runs
        assert not runs[0].done()
        proxy.passthrough()
        p.wait_behind = True
        settle(p, d, rids)
        assert keys_left(url) == []
    finally:
        p.close()
        d.close()


def test_a_shutdown_with_redis_stalled_waits_once_not_once_per_room(
    rig: tuple[str, Proxy, Any],
) -> None:
    """The prefill shuts down holding 8 rooms while its Redis stops answering: it fails
    them in one ``abort_many`` and clears them in one ``clear_many``, so the shutdown
    waits out a few calls' time whatever the number of rooms (each room's own abort
    waited once per room: 8 trips at least), then lets go; the decode learns the
    failure once Redis answers and clears its side, nothing of the decode left."""
    url, proxy, model = rig
    p, d = engines(url, proxy.url(query="call_timeout=0.5"), model, "shut")
    try:
        rids = [f"s{i}" for i in range(8)]
        handed_over(p, d, rids)
        proxy.stall()
        before = RoundTrips.by_thread["MainThread"]
        p.close()  # the engine's shutdown: its worker's, then its scheduler's
        trips = RoundTrips.by_thread["MainThread"] - before
        assert trips < len(rids), trips
    finally:
        proxy.passthrough()
        d.close()
    # the prefill's sender keys keep their TTL; the decode's receivers are gone
    assert [k for k in room_keys(url) if ":rx:" in k] == []


def test_what_a_run_raised_is_raised_by_the_next_hook(
    rig: tuple[str, Proxy, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run behind the step that raises (a defect, not a Redis or transport fault, which
    a run handles itself) is not lost on its thread: the hook that takes its outcome
    raises it, as the step itself would have; the engine's next run goes on."""
    from kvstate.integrations.vllm.rooms import Rooms

    url, _, model = rig
    p, d = engines(url, url, model, "raise")
    try:
        run = Rooms.run

        def broken(self: Rooms, metas: list[Any]) -> Any:
            raise RuntimeError("a defect in the run")

        monkeypatch.setattr(Rooms, "run", broken)
        p.add("r0", 1, {"do_remote_decode": True})
        with pytest.raises(RuntimeError, match="a defect in the run"):
            for _ in range(10):
                p.step()
        monkeypatch.setattr(Rooms, "run", run)
        prefilled(p, ["r1"])  # later runs work
        d.add("r1", 2, p.params["r1"])
        settle(p, d, ["r1"])
    finally:
        p.close()
        d.close()
