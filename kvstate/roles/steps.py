"""A rank's scheduler-step calls, which ``KVManager`` takes in (as redis-py's clients
take their command groups): the batches that answer a step's rooms in one round trip
per Redis node whatever their number (poll, begin, finish, send, init, abort, clear),
and the calls run behind the step (``run_behind``, ``wait=False``). One batch is
planned, run and answered by ``batch``; its clears ride it (``Clears``), and what it
polled tells the change notices (``Notices``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal, TypeVar, overload

from kvstate.errors import InvalidValueError, KVStateError
from kvstate.keys import Side, check_room
from kvstate.poll import KVPoll, PollResults
from kvstate.registry import EngineInfo
from kvstate.roles import batch
from kvstate.roles.behind import Behind
from kvstate.roles.clears import Clears
from kvstate.roles.contract import LookupKey, Step
from kvstate.roles.notices import Notices
from kvstate.roles.participant import Participant, abort_many
from kvstate.roles.peers import PeerWatch
from kvstate.roles.sender import KVSender, send_many
from kvstate.roles.table import Participants
from kvstate.store import Store, one_call

log = logging.getLogger(__name__)
_R = TypeVar("_R")


class StepCalls:
    """A rank's per-step calls; what they read is the rank's (``KVManager``)."""

    store: Store
    role: str
    side: Side
    engine: str
    behind: Behind
    clears: Clears
    notices: Notices
    _parts: Participants
    _peers: PeerWatch

    if TYPE_CHECKING:  # the rank's own

        def check_usable(self, new: bool = False) -> None: ...
        def lease_lapsed(self) -> str: ...
        def prefill_engines(self, key: LookupKey) -> list[EngineInfo]: ...
        def forget(self, part: Step) -> None: ...

    def poll_many(self, rooms: Iterable[object], begin: bool = False) -> PollResults:
        """Poll many rooms of this engine in one round trip per Redis node.

        Returns a ``PollResults``: a dict room -> KVPoll for every room whose Redis node
        answered. On a Cluster, the rooms on a node that cannot be reached within
        ``Options.call_timeout`` are left out of it and listed in ``.errors`` (room ->
        StateConnectionError) while the others are answered; their participants keep
        their last status. Raises StateConnectionError when no node answered.

        ``begin`` (a prefill manager): each sender the poll finds WaitingForInput is
        begun in the same call, as ``begin_many`` would: answered Transferring (its
        infos read: write its pages now) or Failed; every room given is polled. One
        round trip fewer for a step that writes what it finds ready. A sender's first
        poll is its create, which begins nothing, and ``poll_changed`` does not poll
        again a sender answered WaitingForInput earlier: ``begin_many`` those.
        """
        return self._many("poll", rooms, begin=begin)

    def poll_changed(self, begin: bool = False) -> PollResults:
        """``poll_many`` of the rooms of this manager's live participants that may have
        moved since their last answer, answering those rooms only (the others keep
        their status): rooms a change notice named, never answered, not waiting, whose
        last poll went unanswered, or last answered ``Options.notice_sweep`` ago; every
        room where notices may have been lost. A scheduler step that acts on what it
        answers costs the rooms that moved, not the rooms in flight (issue 33 target
        3). Partial results, errors and ``begin`` as ``poll_many``."""
        self.check_usable()
        self._check_begin(begin)
        parts = [(r, p) for r, p in self.notices.due() if r not in self.clears.due]
        if not (parts or self.clears.due):
            return PollResults()
        return self._batch("poll", parts, begin=begin)

    def nothing_due(self) -> bool:
        """``poll_changed`` would poll no room now (no change notice, no new room, none
        past the sweep) and no clear is due: a step with nothing else to do may skip
        it. No round trip; the notices stay for the next poll."""
        self.check_usable()
        return not self.clears.due and self.notices.quiet()

    def begin_many(self, rooms: Iterable[object]) -> PollResults:
        """``begin_transfer()`` of many senders of this (prefill) manager in one round
        trip per Redis node: a scheduler step's worth. Each room is Transferring, or
        Failed (write nothing to it) as ``begin_transfer`` says; a sender that has seen
        no receiver's infos yet is polled instead (it cannot begin before they
        published). Answers and partial results (``.errors``) as ``poll_many``; a room
        with no live sender of this manager is refused (KVStateError) before anything
        is sent."""
        return self._many("begin", rooms)

    @overload
    def finish_many(
        self, rooms: Iterable[object], clear: bool = ..., wait: Literal[True] = ...
    ) -> PollResults: ...

    @overload
    def finish_many(
        self, rooms: Iterable[object], clear: bool = ..., *, wait: Literal[False]
    ) -> Future[PollResults]: ...

    def finish_many(
        self, rooms: Iterable[object], clear: bool = False, wait: bool = True
    ) -> PollResults | Future[PollResults]:
        """``finish_transfer()`` of many senders of this manager in one round trip per
        Redis node: each becomes Success and acks its receivers. As ``begin_many``.

        ``wait=False``: the same batch runs behind the caller, on this manager's own
        thread (``kvstate.roles.behind``), and its answer (or what it raised) is the
        Future's: a step that pushed pages need not wait for the reply, its receivers
        see Success as soon as Redis ran it. This manager's next call, from any
        thread, first waits for it (within the batch's own deadline), so no call
        overtakes it; the senders it finishes answer their outcome once it ended.

        ``clear``: the senders this finish concludes (those Transferring: it answers
        each Success or Failed) are cleared in its round trip, in MULTI/EXEC after the
        finishes, as ``clear_many(later=True)``'s clears ride a batch: for a prefill
        that lets go of a room whatever its outcome, one round trip fewer. A room the
        batch leaves unanswered keeps its sender and no clear is left due for it (a
        clear riding another batch would delete a sender that may not have finished):
        finish it again. One whose reply was lost after its clear ran reads
        ``cleared`` on that next finish, its status still Transferring: concluded,
        its outcome its receivers'."""
        if not wait:
            return self._behind(rooms, lambda checked: self.finish_many(checked, clear))
        if not clear:
            return self._many("finish", rooms)
        todo = list(rooms)
        ending = [
            p
            for r in todo
            if (p := self._parts.get(check_room(r))) is not None
            and p.status == KVPoll.Transferring
            and p.room not in self.clears.due  # one due already stays due
        ]
        self.clears.later(ending)
        try:
            return self._many("finish", todo)
        finally:
            self.clears.withdraw([p for p in ending if p.status == KVPoll.Transferring])

    def send_many(self, pages: Mapping[object, object]) -> PollResults:
        """``send(kv_indices, last=False)`` of many senders of this (prefill) manager,
        room -> source page indices: their pages written together, one pass per
        receiver (``Transport.write_many``: through UCX every room's puts and one
        flush, on one host one check and one series of copies), within
        ``transfer_timeout`` for them all. Each room answers what ``send`` returns:
        Transferring once its pages landed (``finish_many`` them), Failed with why when
        they could not; a room ``send`` would refuse is in ``.errors`` with that error,
        nothing written for it, and so is one whose Redis calls raised (``send`` would
        raise it). A room without a live sender here is refused before any byte moves."""
        self.check_usable()
        if self.side != "tx":
            raise KVStateError(
                f"send_many is for a prefill manager's senders; {self.engine} is {self.role}"
            )
        items: list[tuple[KVSender, object]] = []
        for (_, part), kv in zip(self._parts.resolve(pages, "send"), pages.values(), strict=True):
            assert isinstance(part, KVSender)  # a prefill manager's participants are senders
            items.append((part, kv))
        return send_many(items)

    def init_many(self, pages: Mapping[object, object]) -> PollResults:
        """``init(kv_indices)`` of many receivers of this (decode) manager, room ->
        page indices, in one round trip per Redis node: the pages of every request a
        step allocated, published at once. Each room's answer is what ``init`` returns;
        partial results (``.errors``) as ``poll_many``. Arguments are checked (and the
        transport told) before anything is sent; a room without a live receiver here is
        refused. For aux, state indices, prefix or dummy, call ``init`` itself."""
        self.check_usable()
        wanted = {check_room(room): indices for room, indices in pages.items()}
        return self._many("init", wanted, wanted)

    def abort_many(self, reasons: Mapping[object, str | None]) -> PollResults:
        """``abort()`` of this manager's participants of many rooms, room -> reason, in
        three round trips per Redis node whatever their number (``abort()`` makes three
        each), within one call's time: a step that gives up on many rooms (a dead peer,
        an engine shutting down) is bounded once, not per room. Each room answers its
        status (Failed); a room whose node did not answer, or whose state is corrupt, is
        in ``.errors`` (abort it again); StateConnectionError when no node answered in
        the call's time. A room without a live participant here is refused before
        anything is sent."""
        self.check_usable()
        parts = self._parts.resolve(reasons, "abort")
        why: dict[Participant, str | None] = {}
        for (_, part), reason in zip(parts, reasons.values(), strict=True):
            assert isinstance(part, Participant)  # resolve refuses a room without one
            why[part] = reason
        errors = abort_many(why)
        return PollResults(((p.room, p.status) for p in why if p.room not in errors), errors)

    @overload
    def clear_many(
        self, rooms: Iterable[object], later: bool = ..., wait: Literal[True] = ...
    ) -> dict[int, KVStateError]: ...

    @overload
    def clear_many(
        self, rooms: Iterable[object], later: Literal[False] = ..., *, wait: Literal[False]
    ) -> Future[dict[int, KVStateError]]: ...

    def clear_many(
        self, rooms: Iterable[object], later: bool = False, wait: bool = True
    ) -> dict[int, KVStateError] | Future[dict[int, KVStateError]]:
        """``clear()`` of this manager's participants of many rooms in one round trip
        per Redis node. Returns the rooms not cleared, each with its node's
        StateConnectionError (Cluster, node unreachable): they stay live here and can be
        cleared again; rooms without a live participant here are skipped (a clear is
        idempotent). Raises StateConnectionError when no node answered.

        ``later``: the clears ride this manager's next batch instead (its round trip,
        in MULTI/EXEC beside its calls: ``poll_changed`` makes one while clears are
        due), so a step that concludes rooms pays no trip for their keys; answers {}.
        A clear that batch could not make stays due for the next one (logged); any
        ``clear_many`` now takes the clears still due with it (``kvstate.roles.clears``).

        ``wait=False``: the clears run behind the caller, as ``finish_many``'s, and
        those not made (a node or the whole store unreachable) stay due for the next
        batch, logged; the Future answers the rooms not cleared. For a step whose
        rooms were its last: no later batch may come soon, and it need not wait."""
        if not wait:
            if later:
                raise InvalidValueError(
                    "clear_many(later=True) rides the next batch and makes no round trip of "
                    "its own: nothing to run behind; pass wait=False without later=True"
                )
            return self._behind(rooms, self._clear_or_later)
        self.check_usable()
        todo = [p for r in rooms if (p := self._parts.get(check_room(r))) is not None]
        if not later:
            return self.clears.now(todo)
        self.clears.later(todo)
        for p in todo:
            self.notices.forget(p.room)  # concluded: its clear, not a poll, is due
        return {}

    def run_behind(self, step: Callable[[], _R]) -> Future[_R]:
        """Run ``step``, a scheduler step's calls of this manager, behind the caller on
        this manager's own thread (where ``wait=False`` calls run): the caller goes on
        while Redis answers and pages move, and the Future holds what ``step`` returned
        or raised. A call made inside ``step`` runs at once; one from another thread
        first waits for ``step`` to end, so the caller should look at ``done()`` before
        it calls again (the vLLM worker runs its whole step so)."""
        self.check_usable()
        return self.behind.submit(step)

    def _behind(self, rooms: Iterable[object], call: Callable[[list[int]], _R]) -> Future[_R]:
        """``call(rooms)`` behind the caller (``kvstate.roles.behind``); the rooms checked,
        and a closed or forked manager refused, here rather than in the Future."""
        checked = [check_room(r) for r in rooms]
        self.check_usable()
        return self.behind.submit(lambda: call(checked))

    def _clear_or_later(self, rooms: list[int]) -> dict[int, KVStateError]:
        """Clear now; what could not be cleared rides the next batch."""
        try:
            failed = self.clear_many(rooms)
        except KVStateError as exc:
            log.warning("%s: clearing %d room(s) failed: %s", self.engine, len(rooms), exc)
            failed = dict.fromkeys(rooms, exc)
        self.clear_many(list(failed), later=True)
        return failed

    @property
    def clearing(self) -> list[int]:
        """Rooms whose clear (``clear_many(later=True)``) rides the next batch (once a
        call running behind ended)."""
        self.behind.settle()
        return sorted(self.clears.due)

    def _check_begin(self, begin: bool) -> None:
        if begin and self.side != "tx":
            raise KVStateError(
                f"poll with begin=True is for a prefill manager's senders; {self.engine} "
                f"is {self.role}"
            )

    def _many(
        self,
        op: str,
        rooms: Iterable[object],
        pages: Mapping[int, object] | None = None,
        begin: bool = False,
    ) -> PollResults:
        """One batch of ``op`` (poll, begin, finish, init) over many rooms of this
        manager's side (a poll: a waiting room nobody changed answers its last status)."""
        self.check_usable()
        self._check_begin(begin)
        side = "rx" if op == "init" else "tx"
        if op != "poll" and self.side != side:
            raise KVStateError(
                f"{op}_many is for a {'decode' if side == 'rx' else 'prefill'} manager's "
                f"{'receivers' if side == 'rx' else 'senders'}; {self.engine} is {self.role}"
            )
        parts = self._parts.resolve(rooms, op)
        kept: dict[int, KVPoll] = {}
        if op == "poll" and not begin:  # a begin polls every room it is given
            parts, kept = self.notices.select(parts)
        return self._batch(op, parts, kept, pages, begin)

    @one_call
    def _batch(
        self,
        op: str,
        parts: list[tuple[int, Step | None]],
        kept: Mapping[int, KVPoll] | None = None,
        pages: Mapping[int, object] | None = None,
        begin: bool = False,
    ) -> PollResults:
        """The batch of ``op`` over these participants: creates and bindings still due
        go first in the same batch (a Cluster's: one registry read per address first).
        A room the one-room call would refuse (NotReadyError: begin before its
        receivers published, finish before begin) or whose state is corrupt
        (CorruptStateError) is listed in ``.errors``, the other rooms answered; rooms
        in ``kept`` answer the status given there."""
        lapsed = self.lease_lapsed() if op == "finish" else ""  # once for the batch
        found = batch.lookups(
            (p for _, p in parts if p is not None), self.store.cluster, self.prefill_engines
        )
        plan = batch.plan(
            op,
            parts,
            found,
            lapsed,
            pages or {},
            lambda r: self.store.poll(r, self.side, self.engine),
            begin,
        )
        out, bound = self.clears.run(plan)
        self.notices.polled((r, p) for r, p in parts if r in out)
        for r in out.errors:
            self.notices.ask(r)
        out.update(kept or {})
        for b in bound:
            self._peers.watch(b)
        for _, p in parts:
            if p is not None and p.cleared:  # its own clear had run, its reply was lost
                self.forget(p)
        return out


__all__ = ["StepCalls"]
