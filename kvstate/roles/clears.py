"""A rank's clears: made at once (``KVManager.clear_many``), or riding the rank's next
batch in its round trip (``clear_many(later=True)``), so that a scheduler step that
concludes rooms pays no round trip of its own for their keys. Either way each
participant's clear is its ``clear_calls`` in one MULTI/EXEC per slot (design rule 4),
and a participant is forgotten by its rank only once its clear ran."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from kvstate.errors import KVStateError, StateOutOfMemoryError
from kvstate.poll import PollResults
from kvstate.registry import EngineInfo
from kvstate.roles import batch
from kvstate.roles.contract import Bound, LookupKey, Step
from kvstate.store import Call, Store

log = logging.getLogger(__name__)


class Clears:
    """The clears of one rank, and those due with its next batch."""

    def __init__(
        self,
        store: Store,
        engine: str,
        read: Callable[[LookupKey], list[EngineInfo]],
        forget: Callable[[Step], None],
    ) -> None:
        self.store = store
        self.engine = engine
        self._read = read  # the registry read a receiver's clear may need
        self._forget = forget  # the rank lets go of a participant cleared
        self.due: dict[int, Step] = {}

    def later(self, parts: list[Step]) -> None:
        """These participants' clears ride the next batch (``run``)."""
        for p in parts:
            self.due[p.room] = p

    def withdraw(self, parts: list[Step]) -> None:
        """These participants' clears no longer ride the next batch."""
        for p in parts:
            if self.due.get(p.room) is p:
                del self.due[p.room]

    def now(self, parts: list[Step]) -> dict[int, KVStateError]:
        """Clear these and the clears due, in one round trip per node; the rooms not
        cleared, with their error (those that were due stay due)."""
        due, self.due = self.due, {}
        todo = parts + [p for p in due.values() if p not in parts and not p.cleared]
        sent = [p for p in todo if p.create_sent]
        try:
            errors = self.store.clear_many(self._calls(sent))
        except KVStateError as exc:
            self._ran(todo, [exc] * len(sent), due)
            raise
        return self._ran(todo, errors, due)

    def flush(self) -> None:
        """The clears due, now; where they fail they stay due (logged)."""
        try:
            self.now([])
        except KVStateError as exc:
            log.warning("%s: clearing %d room(s) failed: %s", self.engine, len(self.due), exc)

    def run(self, plan: batch.Plan) -> tuple[PollResults, list[Bound]]:
        """Run a batch with the clears due riding it: in MULTI/EXEC, after its calls. A
        new participant in the batch of a room whose clear is due (the same keys) has
        that clear made first, on a trip of its own."""
        if any(self.due.get(room, p) is not p for room, p, _ in plan.rooms):
            self.flush()
        due, self.due = self.due, {}
        todo = [p for p in due.values() if not p.cleared]
        sent = [p for p in todo if p.create_sent]
        try:
            clears = self._calls(sent)
        except KVStateError:  # a registry read a clear needs: they wait for the next
            clears, todo, sent, self.due = [], [], [], due
        ours = len(plan.calls)
        plan.calls += [replace(c, atomic=True) for group in clears for c in group]
        if not plan.calls:
            self._ran(todo, [], due)
            return PollResults(), []
        try:
            out, bound, replies = batch.run(self.store, plan)
        except StateOutOfMemoryError:
            if not clears:
                raise
            # at maxmemory Redis refuses a MULTI's deletes: the batch alone, then the
            # clears by Store.clear_many, which makes them without the transaction
            del plan.calls[ours:]
            self.due.update(due)
            try:
                return batch.run(self.store, plan)[:2] if plan.calls else (PollResults(), [])
            finally:
                self.flush()
        except KVStateError as exc:
            self._ran(todo, [exc] * len(sent), due)
            raise
        except BaseException:
            self.due.update(due)
            raise
        errors: list[KVStateError | None] = []
        at = ours
        for group in clears:
            failed = [r for r in replies[at : at + len(group)] if isinstance(r, KVStateError)]
            errors.append(failed[0] if failed else None)
            at += len(group)
        if any(errors):
            log.warning(
                "%s: %d clear(s) failed, made again with the next batch: %s",
                self.engine,
                sum(1 for e in errors if e is not None),
                next(e for e in errors if e is not None),
            )
        self._ran(todo, errors, due)
        return out, bound

    def _calls(self, sent: list[Step]) -> list[list[Call]]:
        """Each participant's clear, after the registry reads it needs (a receiver
        whose binding went out unanswered deletes what it may have published)."""
        lookups = batch.lookups(sent, self.store.cluster, self._read, clearing=True)
        return [p.clear_calls(lookups) for p in sent]

    def _ran(
        self, todo: list[Step], errors: Sequence[KVStateError | None], due: Mapping[int, Step]
    ) -> dict[int, KVStateError]:
        """The clears of ``todo`` ran (``errors``: of those whose create went out, in
        order): the cleared ones are forgotten, the others stay live, and those of
        them that were ``due`` stay due."""
        sent = [p for p in todo if p.create_sent]
        failed = {p.room: e for p, e in zip(sent, errors, strict=True) if e is not None}
        for p in sent:
            if p.room in failed:
                p.clear_failed(failed[p.room])
                if p.room in due:
                    self.due[p.room] = p
        for p in todo:
            if p.room not in failed:
                p.after_clear()
                self._forget(p)
        return failed


__all__ = ["Clears"]
