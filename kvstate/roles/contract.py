"""The contract between an engine rank (``KVManager``) and the participants it makes
(``KVSender``, ``KVReceiver``), named below both so that neither imports the other's
private names (docs/design.md, "The rank protocol").

``Rank`` is what a participant may ask of its rank in a call of its own (``poll()``,
``send()``...). ``Step`` is what the rank's batches (``poll_many``, ``begin_many``,
``finish_many``, ``init_many``, ``clear_many``) and its heartbeat ask of a participant:
the rank plans a batch, hands each participant what it needs (``StepInput``: the
registry reads made for the whole batch, the lease check), and each answers with its
calls and, once they ran, with what it learned (``Bound``). Nothing in a batch calls
back up into the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvstate.errors import KVStateError
from kvstate.keys import Side
from kvstate.poll import KVPoll
from kvstate.registry import EngineInfo
from kvstate.stats import TransferRecorder
from kvstate.store import Call, Status, Store
from transports.base import Transport

# (bootstrap addr, named senders or None): one registry read a batch makes for every
# receiver that binds by it (a Cluster's, or one naming its senders)
LookupKey = tuple[str, tuple[str, ...] | None]
Lookups = dict[LookupKey, list[EngineInfo]]


@dataclass(frozen=True)
class StepInput:
    """What a batch hands one participant: the operation (poll, begin, finish, init),
    the registry reads made for the batch, why the rank may have lost its lease (asked
    once per batch; '' when it holds it), for init the pages to publish, and for a
    poll whether a sender found ready is begun in it."""

    op: str
    lookups: Lookups = field(default_factory=dict)
    lapsed: str = ""
    pages: object | None = None
    begin: bool = False


@dataclass(frozen=True)
class Bound:
    """Senders a receiver bound in a call (engine -> incarnation), at its bootstrap
    address: the rank's heartbeat fails the receiver's room if one of them dies."""

    addr: str
    peers: dict[str, str]


class Step(Protocol):
    """What a rank's batches and heartbeat use of any participant: the calls of one
    operation, built without a round trip, so that a scheduler step's rooms go in one
    round trip per Redis node, and what to do with the reply."""

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

    @property
    def waiting(self) -> bool:
        """Its next poll would only read what another participant's script changes (and
        notifies: docs/design.md, "Change notices"), or a timeout: a step may answer its
        last status instead until a notice names its room or the sweep comes."""
        ...

    def lookup_key(self, cluster: bool, clearing: bool = False) -> LookupKey | None:
        """The registry read its next step (or, ``clearing``, its clear) needs, for the
        rank to make once for the whole batch; None when it needs none."""
        ...

    def step_calls(self, step: StepInput) -> tuple[list[Call], int]:
        """The calls of ``step.op``, the create and bindings still due first, and the
        index of the one whose reply is its status."""
        ...

    def step_ran(self, st: Status) -> Bound | None:
        """The batch carrying ``step_calls`` ran; ``st`` is the status reply. Answers
        the senders it bound, for the rank to watch."""
        ...

    def step_lost(self) -> None:
        """The batch did not run, or not whole (its node did not answer): what it would
        have settled (a receiver's binding) is made again by the next operation."""
        ...

    def clear_calls(self, lookups: Lookups | None = None) -> list[Call]:
        """What deletes this participant's keys (``clear``, ``clear_many``)."""
        ...

    def clear_failed(self, exc: KVStateError) -> None:
        """Its clear raised ``exc`` (a clear that may have run reads as cleared later)."""
        ...

    def after_clear(self) -> None:
        """Its keys are deleted: release its pages."""
        ...

    def writes_to(self) -> dict[str, str]:
        """Receiver engine -> the incarnation this participant writes to (a sender's,
        for the prefill side's heartbeat); {} for a receiver."""
        ...

    def peer_died(self) -> None:
        """The heartbeat failed this participant (a peer's engine died)."""
        ...

    def fail_calls(self, addr: str, engine: str, incarnation: str, reason: str) -> list[Call]:
        """The calls that fail it because the prefill engine ``engine`` (that
        incarnation, or any if '') at ``addr`` died: a receiver bound there; [] else."""
        ...


class Rank(Protocol):
    """What a participant may ask of the engine rank that made it, in a call of its
    own: where its state is (store, names, timeouts), how its bytes move (transport,
    recorder), whether it may still act, and the rank-wide reads and watches."""

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

    def prefill_engines(self, key: LookupKey) -> list[EngineInfo]:
        """The live prefill engines a receiver binds to, read fresh per call."""
        ...

    def watch(self, bound: Bound) -> None:
        """A receiver bound these prefill engines: the rank's heartbeat fails its rooms
        if one of them dies."""
        ...

    def peer(self, engine: str, incarnation: str) -> EngineInfo:
        """A receiver's registration (endpoint, layout), for a sender's writes."""
        ...


__all__ = ["Bound", "LookupKey", "Lookups", "Rank", "Step", "StepInput"]
