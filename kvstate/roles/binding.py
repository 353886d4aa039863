"""A receiver's binding to its senders, as a small state machine.

A receiver binds the prefill engines of its bootstrap address as they register (or the
engines it names), each at its incarnation of that moment, and publishes its transfer
info to each; a binding never changes (design.md, "A receiver finds its senders in the
engine registry"). The binding travels inside the receiver's next operation, so it is
always in one of three phases:

- ``IDLE``: nothing in flight; ``bound`` is what Redis confirmed.
- ``LOOKING``: a lookup went out (standalone server: ``publish.lua`` reads the
  address's index itself, keeps the engines named if any, and answers whom it bound).
  Until its answer comes back, the lookup may have bound any engine listed at the
  address: a clear then deletes the infos published to each of them.
- ``NAMING``: a binding to senders chosen here went out (a Cluster, from a registry
  read the caller made); they count as bound once its batch ran.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import Any

from kvstate.registry import EngineInfo
from kvstate.roles.contract import LookupKey
from kvstate.store import Call, Status, Store


class Phase(enum.Enum):
    IDLE = "idle"
    LOOKING = "looking"
    NAMING = "naming"


class Binding:
    """Who a receiver is bound to, how many it needs, and the binding in flight."""

    def __init__(self, addr: str, named: list[str] | None, required: int, want: int = 0) -> None:
        self.addr = addr
        self.named = named
        self.required = required  # 0: not known until the first binding
        self.want = want  # receivers each sender waits for, as declared here (0: none)
        self.bound: dict[str, str] = {}  # sender engine -> incarnation, confirmed
        self.payload = b""  # the transfer info, once init() made it
        self.payloads: dict[str, bytes] = {}  # a sender's own info (its heads), by name
        self.phase = Phase.IDLE
        self.covered = False  # the binding in this batch publishes the payload to all
        self._naming: tuple[dict[str, str], int] = ({}, 0)  # NAMING: new senders, required
        self._unreported: dict[str, str] = {}  # bound since the last settle()

    @property
    def wanted(self) -> int:
        """How many senders to bind: the named ones, else the required count (0: ask)."""
        return len(self.named) if self.named else self.required

    @property
    def done(self) -> bool:
        return bool(self.wanted) and len(self.bound) >= self.wanted

    @property
    def unsure(self) -> bool:
        """A lookup went out and its answer never came back: it may have bound."""
        return self.phase is Phase.LOOKING

    def lookup_key(self, cluster: bool) -> LookupKey | None:
        """The registry read a binding needs first, or None when ``publish.lua`` reads
        the address's index itself (a standalone server: named senders are found
        there too, registered at the receiver's bootstrap address)."""
        if not cluster:
            return None
        return (self.addr, tuple(self.named) if self.named else None)

    def call(
        self, store: Store, room: int, receiver: str, found: list[EngineInfo] | None
    ) -> Call | None:
        """Bind the senders registered since the last look (and publish to them, once
        the payload is made), or None when there is nothing to bind. ``found``: the
        registry read of ``lookup_key`` (None when the script looks them up)."""
        self.covered = not self.bound
        if found is None:
            self.phase = Phase.LOOKING
            publish = store.publish(
                room,
                receiver,
                dict(self.bound),
                self.payload,
                self.required,
                self.addr,
                self.want,
                self.payloads,
                self.named or (),
            )
            return replace(publish, parse=self._answered)
        required = self.required
        if not required and found:  # the group's declared size, or all of it that is up
            required = max(len(found), *(e.ranks for e in found))
        new = {e.engine: e.incarnation for e in found if e.engine not in self.bound}
        if not self.named:
            new = dict(sorted(new.items())[: max(required - len(self.bound), 0)])
        if not new and required == self.required:
            self.covered = False
            return None
        self.phase, self._naming = Phase.NAMING, (new, required)
        return self.publish(store, room, receiver, new, required)

    def publish(
        self, store: Store, room: int, receiver: str, senders: dict[str, str], required: int
    ) -> Call:
        """publish.lua to ``senders``: each its own info where it has one."""
        own = {s: self.payloads[s] for s in senders if s in self.payloads}
        return store.publish(
            room, receiver, senders, self.payload, required, want=self.want, payloads=own
        )

    def _answered(self, raw: Any) -> Status:
        """A lookup's reply, parsed as it comes back: whom it bound is known now."""
        st = Status.parse_bound(raw)
        self.phase = Phase.IDLE
        if st.bound is not None:
            self.bound.update(st.bound)
            if st.required > 0:
                self.required = st.required
            self._unreported.update(st.bound)
        return st

    def answers(self, call: Call) -> bool:
        """Whether ``call`` is a lookup of this binding (its reply is the status)."""
        return call.parse == self._answered

    def settle(self) -> dict[str, str]:
        """The batch carrying the binding ran: the senders bound by it, to watch."""
        if self.phase is Phase.NAMING:
            new, required = self._naming
            self.bound.update(new)
            self.required = required
            self._unreported.update(new)
            self.phase, self._naming = Phase.IDLE, ({}, 0)
        out, self._unreported = self._unreported, {}
        return out

    def lost(self) -> None:
        """The batch carrying a named binding did not run (or not whole): bind again
        with the next operation. A lookup stays LOOKING: it may have run."""
        if self.phase is Phase.NAMING:
            self.phase, self._naming = Phase.IDLE, ({}, 0)

    def senders_to_clear(self, listed: list[EngineInfo] | None) -> list[str]:
        """Every sender this receiver may have published to: bound, in flight, and,
        while ``unsure``, every engine ``listed`` at the address."""
        senders = set(self.bound) | set(self._naming[0])
        if listed is not None:
            senders |= {e.engine for e in listed}
        return sorted(senders)


__all__ = ["Binding", "Phase"]
