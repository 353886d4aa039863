"""Participant: what a room's sender and receiver share. Their KVManager makes them;
they know it only as a ``Rank`` (``kvstate.roles.contract``), and it drives them in
batches through their step interface (``Step``).

A participant is written to Redis with its first operation (poll, init, abort...), in
the same round trip, so creating one costs no round trip of its own. ``clear()`` lives
once, here, for every transport (design rule 4).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstate import schema
from kvstate.errors import (
    InvalidArgumentError,
    KVStateError,
    KVTransferError,
    StateConnectionError,
)
from kvstate.keys import Side, check_room
from kvstate.poll import KVPoll
from kvstate.roles.contract import Bound, LookupKey, Lookups, Rank, StepInput
from kvstate.store import Call, Status, one_call
from kvstate.trace import traceparent

log = logging.getLogger(__name__)
STATE_LOST = (
    "state lost: the participant's keys are gone (expired, cleared elsewhere, or Redis restarted)"
)

_S = TypeVar("_S", bound="Participant")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def participant_call(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """A participant's public call: refused (ManagerClosedError, ForkedManagerError)
    once its manager is closed or in a forked child, else one call (``one_call``: one
    deadline for its round trips)."""
    bounded = one_call(method)

    def checked(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self.mgr.check_usable()
        return bounded(self, *args, **kwargs)

    functools.update_wrapper(checked, method)
    return checked


def checked_context(context: str) -> str:
    """A serving request's trace context, as ``kvstate.trace.traceparent`` reads it."""
    checked = traceparent(context)
    if checked is None:
        raise InvalidArgumentError(
            f"trace_context must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>), "
            f"got {context!r}; kvstate.trace.traceparent() filters a header"
        )
    return checked


def check_reason(reason: object) -> str:
    """Reasons are text in Redis: None (SGLang passes it) reads as 'no reason given';
    anything else that is not text is refused before anything is sent."""
    if reason is None:
        return "no reason given"
    if not isinstance(reason, str):
        raise InvalidArgumentError(f"a failure reason must be text (str), got {reason!r}")
    return reason


# the statuses a participant waits in (``Participant.waiting``)
WAITING = frozenset({KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring})


class Participant:
    """What senders and receivers share: lazy creation, status, abort, the one clear,
    and the step interface (``Step``) their KVManager's batches use."""

    side: Side

    def __init__(
        self,
        mgr: Rank,
        room: object,
        peers: int,
        fields: dict[str, Any],
        trace_context: str | None = None,
    ) -> None:
        mgr.check_usable(new=True)
        if mgr.side != self.side:
            raise KVStateError(f"a {mgr.role} manager cannot make a {type(self).__name__}")
        self.mgr = mgr
        self.store = mgr.store
        self.room = check_room(room)
        self.engine = mgr.engine
        self.key = self.store.keys.participant(self.room, self.side, self.engine)
        timeouts = schema.timeouts_value(
            int(mgr.bootstrap_timeout * 1000), int(mgr.waiting_timeout * 1000)
        )
        # the engine's own address is its registration's, and the default timeouts
        # are poll.lua's when none are stored: neither is written per room
        self._fields: dict[str, Any] = {schema.PEERS: peers}
        if timeouts != schema.DEFAULT_TIMEOUTS_MS:
            self._fields[schema.TIMEOUTS_MS] = timeouts
        self._fields.update(fields)
        self._created = False
        self._create_sent = False  # a create went out; it may have run even if the call failed
        self._clear_sent = False  # a clear went out; it may have run even if the call failed
        self._cleared = False
        self._status = KVPoll.Bootstrapping
        self._reason = ""
        # the serving request's W3C traceparent, kept in a traced room's trace (issue 31)
        self.trace_context = None if trace_context is None else checked_context(trace_context)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.room} engine={self.engine} {self._status.name}>"

    # -- public -----------------------------------------------------------------
    @property
    def status(self) -> KVPoll:
        """The status seen by the last call (no round trip)."""
        return self._status

    @property
    def reason(self) -> str:
        """Why the participant failed, as recorded with the last status seen ('' while
        it has not failed; no round trip)."""
        return self._reason

    @participant_call
    def poll(self) -> KVPoll:
        self._run(self._poll_call())
        return self._status

    @participant_call
    def fail(self, reason: str | None = None) -> KVPoll:
        """Record a failure of this participant only (Failed is sticky)."""
        self._run(
            self.store.update(
                self.room, self.side, self.engine, KVPoll.Failed, check_reason(reason)
            )
        )
        return self._status

    @participant_call
    def abort(self, reason: str | None = "aborted") -> None:
        """Fail every participant of the room, the other side included."""
        error = abort_many({self: reason}).get(self.room)
        if error is not None:
            raise error

    @participant_call
    def failure_exception(self) -> KVTransferError | None:
        """The failure of a Failed room as an exception carrying the recorded reason,
        and the participant cleared; None (nothing cleared) while the room has not
        failed: a live room has no failure to report (abort() it to give up on it)."""
        if not self._cleared and self._created:
            self.poll()
        if self._status != KVPoll.Failed:
            return None
        reason = self._reason or f"room {self.room} failed"
        self.clear()
        return KVTransferError(self.room, reason)

    def clear(self) -> None:
        """Delete everything this participant created (the room's failure mark stays,
        for participants that join later; it expires on its own). Idempotent; never
        raises for state already gone."""
        self.mgr.check_usable()
        if self._cleared:
            return
        if self._create_sent:
            try:
                self.store.clear_many([self.clear_calls()], partial=False)
            except StateConnectionError as exc:
                self.clear_failed(exc)
                raise
        self.after_clear()
        self.mgr.forget(self)

    # -- plumbing -------------------------------------------------------------
    def _create_calls(self, lookups: Lookups | None) -> list[Call]:
        """Calls that go ahead of this participant's next operation, in its batch: the
        create (the first time) and, for a receiver, any binding still to make
        (``lookups``: the batch's registry reads; None in a call of its own)."""
        if self._created:
            return []
        self._create_sent = True
        calls = [self.store.create(self.room, self.side, self.engine, self._fields)]
        if self.trace_context and self.store.traced(self.room):  # same batch, same slot
            calls.append(
                self.store.trace_context(self.room, self.side, self.engine, self.trace_context)
            )
        return calls

    def _poll_call(self, begin: bool = False) -> Call:
        """Its poll; ``begin``: a sender found ready is begun in the same call."""
        return self.store.poll(self.room, self.side, self.engine)

    def _batch(self, call: Call, lookups: Lookups | None) -> tuple[list[Call], int]:
        """The calls of one operation (the create and bindings still due first) and the
        index of the one whose reply is the participant's status. A first poll is the
        create alone: create.lua answers it (with a sender's infos), one script less
        (it begins nothing: a poll's ``begin`` waits for the next)."""
        first = not self._create_sent
        calls = self._create_calls(lookups)
        if not (first and calls and call.script == "poll"):
            calls.append(call)
        at = max(i for i, c in enumerate(calls) if self._answers_status(c))
        return calls, at

    def _answers_status(self, call: Call) -> bool:
        """Whether ``call``'s reply is this participant's status."""
        return call.parse == Status.parse

    def _run(self, call: Call) -> Status:
        """Run one operation in a call of its own, creating the participant first if
        this is its first."""
        if self._cleared:
            return Status(self._status, self._reason)
        calls, at = self._batch(call, None)
        replies = self.store.execute(calls)
        self._created = True
        st: Status = replies[at]
        self._took(st)
        return st

    def _took(self, st: Status) -> None:
        """The status a call of its own answered: absorbed, a binding it made watched,
        the participant forgotten by its rank if its own clear had run."""
        bound = self._absorb(st)
        if bound is not None:
            self.mgr.watch(bound)
        if self._cleared:
            self.mgr.forget(self)

    def _absorb(self, st: Status) -> Bound | None:
        """Take in a status reply; answers the senders bound by the call (receivers)."""
        if st.status is None and self._clear_sent:
            # gone because its own clear ran (the reply was lost): cleared, its last
            # status stands; a finished request must not turn Failed
            self.after_clear()
        elif st.status is None:
            self._status, self._reason = KVPoll.Failed, STATE_LOST
        else:
            self._status, self._reason = st.status, st.reason
        return None

    def _clear_args(self, lookups: Lookups | None) -> dict[str, Any]:
        return {}

    def _step_call(self, step: StepInput) -> Call:
        """A side's call for ``step.op`` in a batch (each side answers its own)."""
        return self._poll_call()

    # -- step interface (kvstate.roles.contract.Step): what KVManager's batches use ----
    @property
    def cleared(self) -> bool:
        """clear() ran: the participant is done; batches skip it."""
        return self._cleared

    @property
    def create_sent(self) -> bool:
        """Its create went out (it may exist in Redis even if that call failed): it has
        keys to clear and can be failed by key."""
        return self._create_sent

    @property
    def waiting(self) -> bool:
        """Created, not cleared, and in a status only another participant's script (which
        notifies) or a timeout (the sweep) moves: Bootstrapping, WaitingForInput,
        Transferring. Its own calls move it too, and it takes in their replies."""
        return self._created and not self._cleared and self._status in WAITING

    def lookup_key(self, cluster: bool, clearing: bool = False) -> LookupKey | None:
        """The registry read its batch needs first (a receiver's binding); None."""
        return None

    def step_calls(self, step: StepInput) -> tuple[list[Call], int]:
        """The calls of ``step.op`` (poll, begin, finish, init) in a batch, the create
        and bindings still due first, and the index of the one whose reply is the
        status."""
        call = self._poll_call(step.begin) if step.op == "poll" else self._step_call(step)
        return self._batch(call, step.lookups)

    def step_ran(self, st: Status) -> Bound | None:
        """The batch carrying ``step_calls`` ran; ``st`` is the status reply."""
        self._created = True  # its create, if any, went to the same node
        return self._absorb(st)

    def step_lost(self) -> None:
        """The batch did not run, or not whole: nothing to undo here (a receiver's
        binding is made again by its next operation)."""

    def clear_calls(self, lookups: Lookups | None = None) -> list[Call]:
        """What deletes this participant's keys (``clear``, ``KVManager.clear_many``)."""
        return self.store.clear_calls(
            self.room, self.side, self.engine, **self._clear_args(lookups)
        )

    def clear_failed(self, exc: KVStateError) -> None:
        """Its clear raised ``exc``: if the clear may have run (only its reply was lost),
        its keys found gone from now on were cleared, not lost."""
        if isinstance(exc, StateConnectionError) and exc.may_have_run:
            self._clear_sent = True

    def after_clear(self) -> None:
        """Its keys are deleted: release its pages."""
        self._cleared = True
        if self.mgr.transport is not None:
            self.mgr.transport.release(self.room)

    def writes_to(self) -> dict[str, str]:
        """Receiver engine -> incarnation this participant writes to ({}: none)."""
        return {}

    def peer_died(self) -> None:
        """The heartbeat failed this participant: its next poll reads Failed."""

    def fail_calls(self, addr: str, engine: str, incarnation: str, reason: str) -> list[Call]:
        """The calls that fail it for a dead prefill engine at ``addr``: none here."""
        return []


def abort_many(reasons: Mapping[Participant, str | None]) -> dict[int, KVStateError]:
    """``abort()`` of many participants of one rank, each with its reason, within one
    call's time and in three round trips per node whatever their number (four where
    one was never written): those not written yet created, their rooms failed for both
    sides (``Store.abort_many``), their statuses read back. Answers the rooms not
    aborted, with why (their node did not answer, or their state is corrupt); raises
    when no node answered. Cleared participants are skipped."""
    why = {
        p: f"{check_reason(r)} (by {p.side}:{p.engine})"
        for p, r in reasons.items()
        if not p._cleared
    }
    if not why:
        return {}
    store = next(iter(why)).store
    with store.bounded():
        store.execute([c for p in why for c in p._create_calls(None)])
        for p in why:
            p._created = True
        answers = store.abort_many({p.room: r for p, r in why.items()})
        errors = {room: e for room, e in answers.items() if isinstance(e, KVStateError)}
        live = [p for p in why if p.room not in errors]
        polled = store.execute([p._poll_call() for p in live], partial=True)
        for p, st in zip(live, polled, strict=True):
            if isinstance(st, KVStateError):
                errors[p.room] = st
            else:
                p._took(st)
    return errors


__all__ = [
    "STATE_LOST",
    "WAITING",
    "Participant",
    "abort_many",
    "check_reason",
    "participant_call",
]
