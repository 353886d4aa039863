"""The two halves of the contract between an engine rank (``kvstate.manager.KVManager``)
and the participants it makes (``kvstate.roles.KVSender`` / ``KVReceiver``).

``Rank`` is what a participant may ask of its rank; ``Step`` is what the rank's
per-step batches (``poll_many``, ``begin_many``, ``finish_many``, ``init_many``,
``clear_many``) and its heartbeat ask of a participant. Both are named here, below
both modules, so that neither imports the other's private names and the imports point
down only (docs/design.md, layers): ``manager`` imports ``roles``, ``roles`` imports
only this module.
"""

from __future__ import annotations

from typing import Protocol

from kvstate.keys import Side
from kvstate.poll import KVPoll
from kvstate.registry import EngineInfo
from kvstate.stats import TransferRecorder
from kvstate.store import Call, Status, Store
from transports.base import Transport

# (bootstrap addr, named senders or None) -> the prefill engines found there: one
# registry read per address among the receivers of one batch
Lookups = dict[tuple[str, tuple[str, ...] | None], list[EngineInfo]]


class Step(Protocol):
    """What a rank's batch calls and heartbeat use of any of its participants: the
    calls of one operation, built without a round trip, so that a scheduler step's
    rooms go in one round trip per Redis node, and what to do with the reply."""

    @property
    def room(self) -> int: ...

    @property
    def side(self) -> Side: ...

    @property
    def status(self) -> KVPoll:
        """The status seen by the last call (no round trip)."""
        ...

    @property
    def cleared(self) -> bool:
        """clear() ran: the participant is done; batches skip it."""
        ...

    @property
    def create_sent(self) -> bool:
        """Its create went out (it may exist in Redis even if that call failed): it has
        keys to clear and can be failed by key."""
        ...

    def step_calls(self, op: str, lookups: Lookups, lapsed: str = "") -> tuple[list[Call], int]:
        """The calls of ``op`` (poll, begin, finish, init) for one batch, the create and
        bindings still due first, and the index of the one whose reply is its status.
        ``lapsed``: why this rank may have lost its lease (asked once per batch)."""
        ...

    def step_ran(self, st: Status) -> None:
        """The batch carrying ``step_calls`` ran; ``st`` is the status reply."""
        ...

    def step_lost(self) -> None:
        """The batch did not run, or not whole (its node did not answer): what it would
        have settled (a receiver's binding) is made again by the next operation."""
        ...

    def clear_calls(self) -> list[Call]:
        """What deletes this participant's keys (``clear``, ``clear_many``)."""
        ...

    def after_clear(self) -> None:
        """Its keys are deleted: release its pages and leave the rank's live rooms."""
        ...


class Rank(Protocol):
    """What a participant may ask of the engine rank that made it: where its state is
    (store, names, timeouts), how its bytes move (transport, recorder), whether it may
    still act, and the rank-wide lookups and watches it takes part in."""

    @property
    def store(self) -> Store: ...

    @property
    def role(self) -> str: ...

    @property
    def side(self) -> Side: ...

    @property
    def engine(self) -> str: ...

    @property
    def incarnation(self) -> str:
        """This run of the engine: receivers publish it, so a restart is told apart."""
        ...

    @property
    def bootstrap_addr(self) -> str: ...

    @property
    def bootstrap_timeout(self) -> float: ...

    @property
    def waiting_timeout(self) -> float: ...

    @property
    def transfer_timeout(self) -> float:
        """What bounds a transport's write (send), instead of the call's Redis time."""
        ...

    @property
    def transport(self) -> Transport | None:
        """What moves the bytes; None when the caller moves them itself."""
        ...

    @property
    def recorder(self) -> TransferRecorder | None:
        """The transfer counters the monitor reads, when the rank keeps them."""
        ...

    def check_usable(self, new: bool = False) -> None:
        """Raise when the rank is closed or a forked copy (and, ``new``, when its engine
        name was taken since): every participant call asks first (design rule 10's
        calls refuse rather than act for a rank that is gone)."""
        ...

    def lease_lapsed(self) -> str:
        """Why this rank may have lost its lease ('' while it surely holds it): a sender
        must not finish then (design rule 3)."""
        ...

    def forget(self, part: Step) -> None:
        """``part`` is cleared: the rank's batches and heartbeat no longer see it."""
        ...

    def prefill_engines(
        self, addr: str, names: list[str] | None, lookups: Lookups | None = None
    ) -> list[EngineInfo]:
        """The live prefill engines a receiver binds to, read fresh per call or batch."""
        ...

    def watch(self, addr: str, bound: dict[str, str]) -> None:
        """A receiver bound these prefill engines (engine -> incarnation): the rank's
        heartbeat fails its rooms if one of them dies."""
        ...

    def peer(self, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout), for a sender's writes."""
        ...


__all__ = ["Lookups", "Rank", "Step"]
