"""The connector's batched step on vLLM 0.34's own Scheduler, its worker side in this
process (``tools/bench/steps``' engine, as the benchmark runs it; the rig's worker
processes elsewhere): the rooms a step pushes are begun by its poll and take one
``finish_many`` whatever their number, and a ``finish_many`` that does not reach Redis
is made on the next step, the rooms concluding as usual (the prefill's Redis behind a
proxy that drops it between two round trips of one step)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstate.roles.participant import Participant
from kvstate.testing import RedisProcess, RoundTrips
from tests.integrations.vllm_engine import keys_left, room_keys
from tests.proxy import Proxy
from tools.bench.steps.engine import behind_trips

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
    """The prefill finishes ``rids`` (rooms made), the decode publishes into them."""
    prefilled(p, rids)
    for rid in rids:
        d.add(rid, 2, p.params[rid])
    for _ in range(2):
        d.step()
    # the prefill's senders wait for as many receivers as they declare: the first poll
    # that sees the infos learns the count, the next finds the rooms ready
    learn = p.step()
    assert learn.hook_trips == {"get_finished": 1}, learn.hook_trips


@pytest.mark.parametrize("n", [1, 8])
def test_a_waiting_step_looks_at_no_room(
    rig: tuple[str, Proxy, Any], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill holds rooms nobody changes: once each was answered, a step reads no
    room's status and makes no round trip, whatever their number (the worker looks at
    what ``poll_changed`` answers and what it acted on itself, not at every room in
    flight). Of a few steps one may meet the 1 s sweep, which polls them all."""
    url, _, model = rig
    p, d = engines(url, url, model, f"wait{n}")
    try:
        prefilled(p, [f"w{i}" for i in range(n)])
        for _ in range(20):  # the subscription confirmed, every room answered once
            if not p.step().trips:
                break
        reads: list[int] = []
        status = Participant.status
        assert status.fget is not None
        counting = property(lambda part: reads.append(part.room) or status.fget(part))
        monkeypatch.setattr(Participant, "status", counting)
        looked = []
        for _ in range(5):
            reads.clear()
            looked.append((p.step().trips, len(reads)))
        assert (0, 0) in looked, looked
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
    """The step that pushes waits for one round trip, its poll, whatever the number of
    rooms: their ``finish_many``, which clears them (``clear=True``), runs behind it
    (``wait=False``), and the next step reads its outcome without a trip of its own
    while a room no decode took yet waits."""
    url, _, model = rig
    p, d = engines(url, url, model, f"flat{n}")
    try:
        rids = [f"r{i}" for i in range(n)]
        prefilled(p, ["held"])
        handed_over(p, d, rids)
        # poll_changed, which begins the rooms, and the decode engine's registration
        # (read once per engine incarnation: this is the first write to it)
        was = behind_trips()
        push = p.step()
        assert push.hook_trips == {"get_finished": 2}, push.hook_trips
        nxt = p.step()  # "held" waits; the pushed rooms are reported sent
        assert nxt.hook_trips == {}, nxt.hook_trips
        assert behind_trips() - was == 1  # finish_many and the clears, one trip
        assert all(r not in p.scheduler.requests for r in rids)
        # cleared with their finish: "held"'s sender is the one left
        assert len([k for k in room_keys(url) if ":tx:" in k]) == 1
        # a second push to the same decode engine: its registration is known
        handed_over(p, d, ["again"])
        assert p.step().hook_trips == {"get_finished": 1}
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
    """The prefill's Redis drops after ``through`` requests of a push step (its
    poll_changed, which begins the rooms, the receivers' registration read the first
    push makes, finish_many with the rooms' clears, behind the step):
    the next steps take each room up where it stopped, the decode gets its KV, no key
    is left and nothing waits for a timeout."""
    url, proxy, model = rig
    p, d = engines(url, proxy.url(), model, f"lost{through}")
    try:
        rids = ["a", "b"]
        handed_over(p, d, rids)
        proxy.drop_after(through)
        was = behind_trips()
        trips = p.step().hook_trips.get("get_finished", 0)
        p.worker.worker.mgr.behind.settle()  # the finish behind the step ended
        assert trips + behind_trips() - was > through, trips
        proxy.passthrough()
        settle(p, d, rids)
        assert keys_left(url) == []
    finally:
        p.close()
        d.close()
