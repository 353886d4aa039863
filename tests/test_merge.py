"""The status merge rule (docs/design.md, "Rules", rule 3) as a property: random
sequences of create / update / abort / clear, run through the real scripts on a real
Redis, agree step by step with a small model of the rule written here:

- forward only: an update to a lower or equal status changes nothing;
- Failed is sticky: nothing moves a Failed participant, and its first reason stays;
- Success is final: no update moves it; only an explicit abort fails it;
- a participant that fails sets the room's failure mark (the first reason stays); one
  moving forward in a marked room fails with the mark's reason instead (one outcome
  per room); an abort fails every participant not yet Failed with the mark's reason
  (its own, when it is the first); a participant created later starts Failed with it;
  clear leaves the mark;
- the mark names the participants the room had when it failed and those created Failed
  after: one of those created again once every participant cleared is a new request
  (the mark goes, it starts Bootstrapping);
- no resurrection: an update or abort of a participant that is gone writes nothing.

Each example uses a room of its own on the flushed session server; a no-op must not
even restamp ``since_ms``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import KVPoll
from kvstate.store import Store
from tests.helpers import assert_every_key_has_ttl, keys_of

PARTICIPANTS = [("tx", "prefill-a.tp0"), ("rx", "decode-b.tp0")]
_rooms = itertools.count(1000)


@dataclass
class Model:
    """What the rule says the room holds: participant -> (status, reason), the failure
    mark's reason and the participants it names."""

    parts: dict[tuple[str, str], tuple[KVPoll, str]] = field(default_factory=dict)
    mark: str | None = None
    named: set[tuple[str, str]] = field(default_factory=set)

    def create(self, who: tuple[str, str]) -> tuple[KVPoll, str]:
        if who in self.parts:
            return self.parts[who]
        if self.mark is not None and who in self.named and not self.parts:
            self.mark, self.named = None, set()  # the room id used again: a new request
        if self.mark is not None:
            self.named.add(who)
            self.parts[who] = (KVPoll.Failed, self.mark)
        else:
            self.parts[who] = (KVPoll.Bootstrapping, "")
        return self.parts[who]

    def fail_room(self, reason: str) -> str:
        """The mark's reason after a failure: the first one stays, with the
        participants of that moment."""
        if self.mark is None:
            self.mark, self.named = reason, set(self.parts)
        return self.mark

    def update(self, who: tuple[str, str], new: KVPoll, reason: str) -> tuple[KVPoll, str] | None:
        cur = self.parts.get(who)
        if cur is None:
            return None  # never re-created
        status, old_reason = cur
        if status in (KVPoll.Failed, KVPoll.Success):
            return cur
        if new == KVPoll.Failed:
            self.parts[who] = (KVPoll.Failed, reason)
            self.fail_room(reason)
        elif new > status and self.mark is not None:
            self.parts[who] = (KVPoll.Failed, self.mark)
        elif new > status:
            self.parts[who] = (new, old_reason)
        return self.parts[who]

    def abort(self, reason: str) -> int:
        reason = self.fail_room(reason)
        moved = 0
        for who, (status, _) in self.parts.items():
            if status != KVPoll.Failed:
                self.parts[who] = (KVPoll.Failed, reason)
                moved += 1
        return moved

    def clear(self, who: tuple[str, str]) -> None:
        self.parts.pop(who, None)


reasons = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
who = st.sampled_from(PARTICIPANTS)
update = st.tuples(st.just("update"), who, st.sampled_from(list(KVPoll)), reasons)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("create"), who),
        update,
        update,  # twice: updates are what the rule is about
        st.tuples(st.just("abort"), reasons),
        st.tuples(st.just("clear"), who),
    ),
    max_size=16,
)
# Most of the rule is about participants that exist: usually start with both created.
scenarios = st.tuples(st.booleans(), ops).map(
    lambda b_ops: ([("create", w) for w in PARTICIPANTS] if b_ops[0] else []) + b_ops[1]
)


NAMESPACE = "merge"  # of the ``store`` fixture (tests/conftest.py)


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server only."""
    return redis_url


def _stored(store: Store, room: int, who: tuple[str, str]) -> tuple[str | None, str, str]:
    """(status, reason, since_ms) as redis-cli would show them; status None if gone."""
    side, engine = who
    key = store.keys.participant(room, side, engine)  # type: ignore[arg-type]
    status, reason, since, created = store.client.hmget(
        key, "status", "reason", "since_ms", "created_ms"
    )
    if status is None:
        return None, "", ""
    return status.decode(), (reason or b"").decode(), (since or created).decode()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenarios)
def test_status_merge_follows_the_rule(store: Store, steps: list[tuple]) -> None:
    room = next(_rooms)
    model = Model()
    for step in steps:
        before = {w: _stored(store, room, w) for w in PARTICIPANTS}
        if step[0] == "create":
            side, engine = step[1]
            st_ = store.execute([store.create(room, side, engine, {"peers": 1})])[0]
            want = model.create(step[1])
            assert (st_.status, st_.reason) == want, step
        elif step[0] == "update":
            (side, engine), new, reason = step[1:]
            st_ = store.execute([store.update(room, side, engine, new, reason)])[0]
            want_or_none = model.update(step[1], new, reason)
            if want_or_none is None:
                assert st_.status is None, step
            else:
                assert (st_.status, st_.reason) == want_or_none, step
        elif step[0] == "abort":
            assert store.abort(room, step[1]) == model.abort(step[1]), step
        else:
            side, engine = step[1]
            store.clear(room, side, engine)
            model.clear(step[1])
        # what is stored, participant by participant, and the abort mark
        for w in PARTICIPANTS:
            status, reason, since = _stored(store, room, w)
            expected = model.parts.get(w)
            if expected is None:
                assert status is None, (step, w)
                continue
            assert (status, reason) == (expected[0].name, expected[1]), (step, w)
            if before[w][0] == status and step[0] != "create":
                assert since == before[w][2], ("a no-op restamped since_ms", step, w)
        mark = {
            k.decode(): v.decode()
            for k, v in store.client.hgetall(store.keys.aborted(room)).items()
        }
        assert mark.pop("reason", None) == model.mark, step
        assert set(mark) == {f"{side}:{engine}" for side, engine in model.named}, step
    assert_every_key_has_ttl(store)
    for side, engine in PARTICIPANTS:  # idempotent; each one also deletes the mark
        store.clear(room, side, engine)  # type: ignore[arg-type]
    assert not [k for k in keys_of(store) if f"{{{room}}}" in k]


def test_every_single_transition(store: Store) -> None:
    """The whole transition table, one step from each status: random sequences rarely
    hit a given pair (Success then Failed, say), so every pair is also tried once."""
    rooms = itertools.count(1)
    for cur, new in itertools.product(KVPoll, KVPoll):
        room = next(rooms)
        model = Model()
        tx = PARTICIPANTS[0]
        store.execute([store.create(room, *tx, {"peers": 1})])  # type: ignore[arg-type]
        model.create(tx)
        if cur != KVPoll.Bootstrapping:
            store.execute([store.update(room, *tx, cur, "first")])  # type: ignore[arg-type]
            model.update(tx, cur, "first")
        got = store.execute([store.update(room, *tx, new, "second")])[0]  # type: ignore[arg-type]
        want = model.update(tx, new, "second")
        assert want is not None and (got.status, got.reason) == want, (cur, new)
        assert _stored(store, room, tx)[:2] == (want[0].name, want[1]), (cur, new)
        # and an explicit abort from there: only Failed stays as it is
        assert store.abort(room, "abort") == model.abort("abort"), (cur, new)
        assert _stored(store, room, tx)[:2] == (model.parts[tx][0].name, model.parts[tx][1])
        store.clear(room, *tx)  # type: ignore[arg-type]
    assert keys_of(store) == []
