"""KVReceiver: the decode side of one room. It binds its senders (``Binding``) and
publishes where each must write (its transfer info); its status becomes Success when
every sender it needs acked."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from kvstate import schema
from kvstate.codec import MAX_INDEX, TransferInfo, as_indices, is_int
from kvstate.errors import InvalidIndicesError, InvalidValueError, KVStateError
from kvstate.keys import Side, check_name
from kvstate.poll import KVPoll
from kvstate.roles.binding import Binding
from kvstate.roles.contract import Bound, LookupKey, Lookups, Rank, StepInput
from kvstate.roles.participant import Participant, participant_call
from kvstate.store import Call, Status
from kvstate.tp import Route
from transports.base import TransportError

log = logging.getLogger(__name__)
_MIN_BULK_LIMIT = 1 << 20  # the smallest proto-max-bulk-len Redis accepts


class KVReceiver(Participant):
    """The decode side of a room. It binds to the prefill engines of its address as they
    register (until it has ``required_senders`` of them, or the engines named in
    ``senders``), each at its incarnation of that moment; the binding is part of its
    next operation, so a prefill that is not up yet leaves it Bootstrapping (and Failed
    after ``bootstrap_timeout``), never raises."""

    side: Side = "rx"

    def __init__(
        self,
        mgr: Rank,
        room: object,
        bootstrap_addr: str,
        senders: list[str] | None,
        required_senders: int | None,
        routes: dict[str, Route] | None = None,
        receivers_per_sender: int = 0,
        trace_context: str | None = None,
    ) -> None:
        if required_senders is not None and (not is_int(required_senders) or required_senders < 1):
            raise InvalidValueError(
                f"required_senders must be an int >= 1, got {required_senders!r}"
            )
        if senders is not None and not senders:
            raise InvalidValueError("senders, when given, must name at least one prefill engine")
        for r in (routes or {}).values():
            if not isinstance(r, Route):
                raise InvalidValueError(f"a sender's route must be a kvstate.tp.Route, got {r!r}")
        if not is_int(receivers_per_sender) or receivers_per_sender < 0:
            raise InvalidValueError(
                f"receivers_per_sender must be an int >= 0, got {receivers_per_sender!r}"
            )
        self.bootstrap_addr = check_name(bootstrap_addr, "bootstrap_addr")
        required = required_senders or (len(senders) if senders else 0)  # 0: not known
        self._binding = Binding(self.bootstrap_addr, senders, required, receivers_per_sender)
        self._routes = routes or {}
        fields: dict[str, object] = {schema.PEER_ADDR: bootstrap_addr}
        if required:  # bound is stored while it differs from peers: none bound yet
            fields[schema.BOUND] = 0
        super().__init__(mgr, room, required, fields, trace_context)

    @property
    def senders(self) -> list[str]:
        """The sender engines bound so far."""
        return sorted(self._binding.bound)

    @property
    def routes(self) -> dict[str, Route]:
        """What each named sender writes for this receiver (heterogeneous TP), by name."""
        return dict(self._routes)

    @property
    def bound(self) -> dict[str, str]:
        """The senders bound so far, each at the incarnation it was bound to."""
        return dict(self._binding.bound)

    # -- plumbing ---------------------------------------------------------------------
    def _create_calls(self, lookups: Lookups | None) -> list[Call]:
        calls = super()._create_calls(lookups)
        if calls:
            calls.append(self.store.track(self.bootstrap_addr, self.room, self.engine))
        bind = self._bind_call(lookups)
        return calls + [bind] if bind is not None else calls

    @property
    def waiting(self) -> bool:
        """As a participant's, and no binding due (its poll would make it)."""
        return super().waiting and not self._binding_due()

    def _binding_due(self) -> bool:
        return not (
            self._cleared or self._status in (KVPoll.Failed, KVPoll.Success) or self._binding.done
        )

    def _bind_call(self, lookups: Lookups | None) -> Call | None:
        """The binding still due, if any: by address on a standalone server the script
        reads the registry's index itself (no read of its own); otherwise from the
        registry read of ``lookups`` (the batch's), or, in a call of its own, one made
        here."""
        if not self._binding_due():
            return None
        key = self._binding.lookup_key(self.store.cluster)
        found = None
        if key is not None:
            found = self.mgr.prefill_engines(key) if lookups is None else lookups[key]
        return self._binding.call(self.store, self.room, self.engine, found)

    def _answers_status(self, call: Call) -> bool:
        return self._binding.answers(call) or super()._answers_status(call)

    def _batch(self, call: Call, lookups: Lookups | None) -> tuple[list[Call], int]:
        """As a participant's; an init's publish is left out when the binding ahead of
        it carries the same transfer info to every sender bound (none was before it):
        the one publish.lua call does both (issue 22)."""
        self._binding.covered = False
        calls, at = super()._batch(call, lookups)
        if (
            self._binding.covered
            and self._binding.payload
            and call.script == "publish"
            and len(calls) > 1
            and calls[-1] is call
        ):
            calls.pop()
            at = len(calls) - 1
        return calls, at

    def _absorb(self, st: Status) -> Bound | None:
        new = self._binding.settle()
        super()._absorb(st)
        return Bound(self.bootstrap_addr, new) if new else None

    def _publish_call(self) -> Call:
        b = self._binding
        return b.publish(self.store, self.room, self.engine, dict(b.bound), b.required)

    def _step_call(self, step: StepInput) -> Call:
        """The publish of ``init`` for a batch (KVManager.init_many): its pages first."""
        self.prepare(step.pages, None, None, 0, False)
        return self._publish_call()

    def _clear_args(self, lookups: Lookups | None) -> dict[str, Any]:
        listed = None
        if self._binding.unsure:
            # a lookup's answer was lost: it may have bound (and published to) any
            # engine listed at the address; their xfer fields go too (one read, only
            # in this case; the fields expire with their key when it fails)
            key = (self.bootstrap_addr, None)
            if lookups is not None:
                listed = lookups.get(key)  # the batch's read failed: logged there
            else:
                try:
                    listed = self.mgr.prefill_engines(key)
                except KVStateError as exc:
                    log.warning(
                        "room %s: could not read %s: %s", self.room, self.bootstrap_addr, exc
                    )
        return {
            "senders": self._binding.senders_to_clear(listed),
            "peer_addr": self.bootstrap_addr,
        }

    # -- step interface ---------------------------------------------------------------
    def lookup_key(self, cluster: bool, clearing: bool = False) -> LookupKey | None:
        if clearing:
            return (self.bootstrap_addr, None) if self._binding.unsure else None
        return self._binding.lookup_key(cluster) if self._binding_due() else None

    def step_lost(self) -> None:
        """The batch that carried a binding did not run (or not whole): bind again on
        the next operation."""
        self._binding.lost()

    def fail_calls(self, addr: str, engine: str, incarnation: str, reason: str) -> list[Call]:
        """A receiver bound at ``addr`` fails when that prefill engine died."""
        if addr != self.bootstrap_addr or not self._create_sent or self._cleared:
            return []
        return [self.store.fail_receiver(self.key, engine, incarnation, reason)]

    # -- public -------------------------------------------------------------------------
    def prepare(
        self,
        kv_indices: object,
        aux_index: int | None,
        state_indices: object | None,
        prefix_len: int,
        dummy: bool,
    ) -> None:
        """Check init()'s arguments, make the pages ready, encode the transfer info
        (``init``, and ``KVManager.init_many`` before its batch)."""
        idx = as_indices(kv_indices)
        state = None if state_indices is None else as_indices(state_indices, "state_indices")
        # bounded like page indices (aux) and by msgpack's int64 (prefix): an int too
        # large to encode must be refused here, not surface as msgpack's OverflowError
        if aux_index is not None and (not is_int(aux_index) or not 0 <= aux_index <= MAX_INDEX):
            raise InvalidIndicesError(f"aux_index must be an int in [0, 2**31), got {aux_index!r}")
        if not is_int(prefix_len) or not 0 <= prefix_len < 2**63:
            raise InvalidIndicesError(
                f"prefix_len must be an int in [0, 2**63), got {prefix_len!r}"
            )
        if self.mgr.transport is not None and not dummy:
            try:
                self.mgr.transport.expect(self.room, idx)
            except TransportError as exc:
                raise InvalidIndicesError(f"room {self.room}: {exc}") from None
        info = TransferInfo(
            self.engine,
            idx,
            aux_index,
            state,
            prefix_len,
            dummy,
            self.mgr.incarnation,
            want=self._binding.want,
        )
        self._binding.payload = info.encode()
        self._binding.payloads = {
            sender: replace(
                info,
                heads=None if r.heads is None else (r.heads.src, r.heads.dst, r.heads.count),
                dummy=dummy or r.dummy,
            ).encode()
            for sender, r in self._routes.items()
        }

    @participant_call
    def init(
        self,
        kv_indices: object,
        aux_index: int | None = None,
        state_indices: object | None = None,
        prefix_len: int = 0,
        dummy: bool = False,
    ) -> KVPoll:
        """Publish where each sender must write; the pages are made ready first. Senders
        that bind later get the same info when they do."""
        self.prepare(kv_indices, aux_index, state_indices, prefix_len, dummy)
        creating = not self._created
        try:
            self._run(self._publish_call())
        except KVStateError as exc:
            err = exc
            self._binding.lost()  # that batch did not run (or not whole): bind again later
            size = max(len(p) for p in (self._binding.payload, *self._binding.payloads.values()))
            oversize = size >= _MIN_BULK_LIMIT  # Redis hangs up on it: reads as "down"
            if oversize:
                self._binding.payload = b""  # never to be sent again by a later binding
                self._binding.payloads = {}
                err = KVStateError(
                    f"room {self.room}: init() failed ({exc}); its transfer info is {size} "
                    "bytes, and Redis drops a connection sent a value above its "
                    "proto-max-bulk-len: raise that, or publish fewer or less fragmented pages"
                )
            if oversize or (creating and self._create_sent):  # it exists: say why
                self._fail_quietly(f"init() refused by Redis: {err}")
            if err is exc:
                raise
            raise err from None
        return self._status

    def _fail_quietly(self, reason: str) -> None:
        """Fail this receiver after an error, when Redis may be what failed."""
        try:
            self._absorb(
                self.store.execute(
                    [self.store.update(self.room, "rx", self.engine, KVPoll.Failed, reason)]
                )[0]
            )
        except KVStateError as exc:
            log.warning("room %s: could not record %r: %s", self.room, reason, exc)


__all__ = ["KVReceiver"]
