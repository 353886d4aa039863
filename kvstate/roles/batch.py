"""A scheduler step's batch, one way through: the rank plans it (each participant's
calls, from what the rank read for the whole batch), the store runs it in one round
trip per Redis node, and each participant is told its reply. Nothing here calls back
into the rank; what participants learned (bindings) is handed back to it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstate.errors import KVStateError, NotReadyError
from kvstate.poll import KVPoll, PollResults
from kvstate.registry import EngineInfo
from kvstate.roles.contract import Bound, LookupKey, Lookups, Step, StepInput
from kvstate.store import Call, Store

log = logging.getLogger(__name__)

# what begin_many / finish_many may answer for a room; any other status is not ready
READY = {
    "begin": (KVPoll.Transferring, KVPoll.Success, KVPoll.Failed),
    "finish": (KVPoll.Success, KVPoll.Failed),
}


@dataclass
class Plan:
    """The calls of one batch and, per room, its live participant (None: a bare room,
    polled without one) and the index of the reply that is its status."""

    op: str
    rooms: list[tuple[int, Step | None, int]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


def plan(
    op: str,
    parts: list[tuple[int, Step | None]],
    lookups: Lookups,
    lapsed: str,
    pages: Mapping[int, object],
    bare: Callable[[int], Call],
    begin: bool = False,
) -> Plan:
    """The batch of ``op`` over ``parts``; ``bare(room)`` polls a room without a live
    participant; ``begin``: a poll begins the senders it finds ready. A participant's
    arguments are checked (and, for init, its pages made ready) as its calls are
    built, before anything is sent."""
    out = Plan(op)
    for room, p in parts:
        if p is None:
            out.rooms.append((room, None, len(out.calls)))
            out.calls.append(bare(room))
            continue
        more, at = p.step_calls(StepInput(op, lookups, lapsed, pages.get(room), begin))
        out.rooms.append((room, p, len(out.calls) + at))
        out.calls += more
    return out


def lookups(
    parts: Iterable[Step],
    cluster: bool,
    read: Callable[[LookupKey], list[EngineInfo]],
    clearing: bool = False,
) -> Lookups:
    """The registry reads the participants need, each made once (one per address, or
    named group). For a clear (``clearing``), a read that fails is logged and left out:
    the fields it would name expire with their key."""
    out: Lookups = {}
    for p in parts:
        key = p.lookup_key(cluster, clearing)
        if key is None or key in out:
            continue
        try:
            out[key] = read(key)
        except KVStateError as exc:
            if not clearing:
                raise
            log.warning("could not read the prefill engines at %s: %s", key[0], exc)
    return out


def run(store: Store, batch: Plan) -> tuple[PollResults, list[Bound], list[Any]]:
    """Send the batch, one round trip per node, and answer it (``answer``); the raw
    replies too (of calls added after planning: clears riding the batch)."""
    try:
        replies = store.execute(batch.calls, partial=True)
    except BaseException:
        lost(batch)  # bindings in that batch did not run (or not whole)
        raise
    return (*answer(batch, replies), replies)


def lost(batch: Plan) -> None:
    """The batch did not run (or not whole): bindings in it are made again later."""
    for _, p, _ in batch.rooms:
        if p is not None:
            p.step_lost()


def answer(batch: Plan, replies: Sequence[Any]) -> tuple[PollResults, list[Bound]]:
    """Each room's answer (its node's error in ``.errors``, and a room the one-room call
    would refuse as not ready), and the bindings the participants made."""
    out = PollResults()
    bound: list[Bound] = []
    for room, p, i in batch.rooms:
        st = replies[i]
        if isinstance(st, KVStateError):  # that room's node did not answer
            out.errors[room] = st
            if p is not None:
                p.step_lost()
        elif p is not None:
            made = p.step_ran(st)
            if made is not None:
                bound.append(made)
            # one found cleared (its own clear had run, the reply lost) answers its
            # last status: nothing is left to refuse
            if batch.op in READY and p.status not in READY[batch.op] and not p.cleared:
                out.errors[room] = not_ready(room, batch.op, p.status)
            else:
                out[room] = p.status
        else:
            out[room] = st.status if st.status is not None else KVPoll.Failed
    return out, bound


def not_ready(room: int, op: str, status: KVPoll) -> NotReadyError:
    """What a batch says of a room its one-room call would refuse (nothing written)."""
    return NotReadyError(
        f"room {room}: not {'begun' if op == 'begin' else 'finished'}, nothing "
        f"written (status {status.name}): "
        + (
            "wait for WaitingForInput (every receiver published), poll, then begin"
            if op == "begin"
            else "begin_many (or begin_transfer) first"
        )
    )


__all__ = ["READY", "Plan", "answer", "lookups", "lost", "not_ready", "plan", "run"]
