"""KVSender and KVReceiver: one engine's side of one room, where room state and KV
bytes meet. Their KVManager (kvstate.manager) makes them; they know it only as a
``kvstate.rank.Rank``, and it drives them in batches through their step interface
(``kvstate.rank.Step``).

A participant is written to Redis with its first operation (poll, init,
abort...), in the same round trip, so creating one costs no round trip of its own.
``clear()`` lives once, in the base class, for every transport.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstate import schema
from kvstate.codec import MAX_INDEX, TransferInfo, as_indices, is_int, unpack
from kvstate.errors import (
    CorruptStateError,
    InvalidArgumentError,
    InvalidIndicesError,
    InvalidValueError,
    KVStateError,
    KVTransferError,
    NotReadyError,
)
from kvstate.keys import Side, check_name, check_room
from kvstate.poll import KVPoll
from kvstate.rank import Lookups, Rank
from kvstate.store import Call, Status, one_call
from kvstate.store.deadline import paused
from transports.base import Target, TransportError

log = logging.getLogger(__name__)
STATE_LOST = (
    "state lost: the participant's keys are gone (expired, cleared elsewhere, or Redis restarted)"
)


_S = TypeVar("_S", bound="Participant")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _call(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A participant's public call: refused (ManagerClosedError, ForkedManagerError)
    once its manager is closed or in a forked child, else one call (``one_call``: one
    deadline for its round trips)."""
    bounded = one_call(method)

    def checked(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self.mgr.check_usable()
        return bounded(self, *args, **kwargs)

    functools.update_wrapper(checked, method)
    return checked


_MIN_BULK_LIMIT = 1 << 20  # the smallest proto-max-bulk-len Redis accepts


def _reason(reason: object) -> str:
    """Reasons are text in Redis: None (SGLang passes it) reads as 'no reason given';
    anything else that is not text is refused before anything is sent."""
    if reason is None:
        return "no reason given"
    if not isinstance(reason, str):
        raise InvalidArgumentError(f"a failure reason must be text (str), got {reason!r}")
    return reason


class Participant:
    """What senders and receivers share: lazy creation, status, abort, the one clear,
    and the step interface (``kvstate.rank.Step``) their KVManager's batches use."""

    side: Side

    def __init__(self, mgr: Rank, room: object, peers: int, fields: dict[str, Any]) -> None:
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
        self._cleared = False
        self._status = KVPoll.Bootstrapping
        self._reason = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.room} engine={self.engine} {self._status.name}>"

    # -- plumbing -------------------------------------------------------------
    def _create_calls(self, lookups: Lookups | None = None) -> list[Call]:
        """Calls that go ahead of this participant's next operation, in its batch: the
        create (the first time) and, for a receiver, any binding still to make."""
        self.mgr.check_usable()
        if self._created:
            return []
        self._create_sent = True
        return [self.store.create(self.room, self.side, self.engine, self._fields)]

    def _poll_call(self) -> Call:
        return self.store.poll(self.room, self.side, self.engine)

    def _batch(self, call: Call, lookups: Lookups | None = None) -> tuple[list[Call], int]:
        """The calls of one operation (the create and bindings still due first) and the
        index of the one whose reply is the participant's status. A first poll is the
        create alone: create.lua answers it (with a sender's infos), one script less."""
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
        """Run one operation, creating the participant first if this is its first."""
        if self._cleared:
            return Status(self._status, self._reason)
        calls, at = self._batch(call)
        replies = self.store.execute(calls)
        self._created = True
        return self._absorb(replies[at])

    def _absorb(self, st: Status) -> Status:
        if st.status is None:
            self._status, self._reason = KVPoll.Failed, STATE_LOST
        else:
            self._status, self._reason = st.status, st.reason
        return st

    # -- public -----------------------------------------------------------------
    @property
    def status(self) -> KVPoll:
        """The status seen by the last call (no round trip)."""
        return self._status

    @_call
    def poll(self) -> KVPoll:
        self._run(self._poll_call())
        return self._status

    @_call
    def fail(self, reason: str | None = None) -> KVPoll:
        """Record a failure of this participant only (Failed is sticky)."""
        self._run(
            self.store.update(self.room, self.side, self.engine, KVPoll.Failed, _reason(reason))
        )
        return self._status

    @_call
    def abort(self, reason: str | None = "aborted") -> None:
        """Fail every participant of the room, the other side included."""
        if self._cleared:
            return
        self.store.execute(self._create_calls())
        self._created = True
        self.store.abort(self.room, f"{_reason(reason)} (by {self.side}:{self.engine})")
        self.poll()

    @_call
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
            self.store.clear_many([self.clear_calls()], partial=False)
        self.after_clear()

    def _clear_args(self) -> dict[str, Any]:
        return {}

    def _release(self) -> None:
        if self.mgr.transport is not None:
            self.mgr.transport.release(self.room)

    # -- step interface (kvstate.rank.Step): what KVManager's batches and heartbeat use
    @property
    def cleared(self) -> bool:
        """clear() ran: the participant is done; batches skip it."""
        return self._cleared

    @property
    def create_sent(self) -> bool:
        """Its create went out (it may exist in Redis even if that call failed): it has
        keys to clear and can be failed by key."""
        return self._create_sent

    def step_calls(self, op: str, lookups: Lookups, lapsed: str = "") -> tuple[list[Call], int]:
        """The calls of ``op`` (poll, begin, finish, init) in a batch, the create and
        bindings still due first, and the index of the one whose reply is the status."""
        return self._batch(
            self._poll_call() if op == "poll" else self._step_call(op, lapsed), lookups
        )

    def _step_call(self, op: str, lapsed: str = "") -> Call:
        """A side's call for ``op`` in a batch (each side answers its own)."""
        return self._poll_call()

    def step_ran(self, st: Status) -> None:
        """The batch carrying ``step_calls`` ran; ``st`` is the status reply."""
        self._created = True  # its create, if any, went to the same node
        self._absorb(st)

    def step_lost(self) -> None:
        """The batch did not run, or not whole: nothing to undo here (a receiver's
        binding is made again by its next operation)."""

    def clear_calls(self) -> list[Call]:
        """What deletes this participant's keys (``clear``, ``KVManager.clear_many``)."""
        return self.store.clear_calls(self.room, self.side, self.engine, **self._clear_args())

    def after_clear(self) -> None:
        """Its keys are deleted: release its pages and leave the rank's live rooms."""
        self._cleared = True
        self._release()
        self.mgr.forget(self)


class KVSender(Participant):
    """The prefill side of a room."""

    side: Side = "tx"

    def __init__(self, mgr: Rank, room: object, required_receivers: int = 1) -> None:
        if not is_int(required_receivers) or required_receivers < 1:
            raise InvalidValueError(
                f"required_receivers must be an int >= 1, got {required_receivers!r}"
            )
        super().__init__(mgr, room, required_receivers, {})
        self._infos: dict[str, bytes] = {}
        self._infos_version = -1  # poll.lua returns the infos only when this is stale
        self._decoded: dict[str, TransferInfo] | None = None
        self._incarnations: tuple[dict[str, bytes], dict[str, str]] | None = None
        self._num_pages: int | None = None
        self._sent = 0
        self._peer_failed = False  # the heartbeat failed it: a receiver's engine died

    def _poll_call(self) -> Call:
        return self.store.poll(
            self.room, "tx", self.engine, with_infos=True, infos_version=self._infos_version
        )

    def _absorb(self, st: Status) -> Status:
        if st.version >= 0:
            self._infos_version = st.version
            if st.infos != self._infos:
                self._infos, self._decoded = st.infos, None
        return super()._absorb(st)

    @property
    def published(self) -> list[str]:
        """The receivers that published to this sender, as of the last poll (no round
        trip)."""
        return list(self._infos)

    def writes_to(self) -> dict[str, str]:
        """Receiver engine -> the incarnation this sender writes to, for its KVManager's
        heartbeat to watch; {} when there is nothing to watch (no receiver published
        yet, cleared, terminal, or failed by the heartbeat already). Reads only the
        incarnation, cached per infos (CorruptStateError when one is not text)."""
        if (
            not self._infos
            or self._cleared
            or self._peer_failed
            or self._status in (KVPoll.Failed, KVPoll.Success)
        ):
            return {}
        infos = self._infos
        cached = self._incarnations
        if cached is not None and cached[0] is infos:
            return cached[1]
        key = self.store.keys.room_hash(self.room)
        out = {}
        for receiver, raw in infos.items():
            name = schema.xfer_field(self.engine, receiver)
            inc = unpack(raw, key, name).get("inc")
            if not isinstance(inc, str):
                raise CorruptStateError(key, name, f"incarnation {inc!r} is not text")
            if inc:
                out[receiver] = inc
        self._incarnations = (infos, out)
        return out

    def _clear_args(self) -> dict[str, Any]:
        # the infos it read go with it; one published since goes with its receiver
        return {"receivers": sorted(self._infos)}

    def peer_died(self) -> None:
        """The heartbeat failed this sender (a receiver's engine died): once is enough,
        its next poll reads Failed."""
        self._peer_failed = True

    @_call
    def transfer_infos(self) -> dict[str, TransferInfo]:
        """What each receiver published, decoded strictly (as of the last poll)."""
        if not self._infos and not self._cleared:
            self.poll()
        if self._decoded is None:
            key = self.store.keys.room_hash(self.room)
            self._decoded = {
                r: TransferInfo.decode(r, raw, key, schema.xfer_field(self.engine, r))
                for r, raw in self._infos.items()
            }
        return self._decoded

    @property
    def prefix_len(self) -> int:
        """Tokens the receivers already have cached (the smallest of theirs)."""
        infos = self.transfer_infos()
        return min((i.prefix_len for i in infos.values()), default=0)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """Announce how many pages ``send()`` will move (checked there). ``aux_index`` is
        accepted for SGLang's signature; aux data is not moved by kvstate's transport."""
        self.mgr.check_usable()
        if not is_int(num_kv_indices) or num_kv_indices < 0:
            raise InvalidIndicesError(f"num_kv_indices must be an int >= 0, got {num_kv_indices!r}")
        self._num_pages = num_kv_indices

    def _step_call(self, op: str, lapsed: str = "") -> Call:
        """begin or finish for a batch (KVManager.begin_many / finish_many), with the
        receivers of the last poll; a poll while none has published yet."""
        if not self._infos:
            return self._poll_call()
        receivers = list(self._infos)
        if op == "begin":
            return self.store.begin(self.room, self.engine, receivers)
        return self._finish_call(receivers, lapsed)

    def _receivers(self) -> list[str]:
        """The receivers that published to this sender (polling once if none has yet):
        their names only, without decoding the infos' page indices (send() does)."""
        if not self._infos and not self._cleared:
            self.poll()
        return list(self._infos)

    @_call
    def begin_transfer(self) -> KVPoll:
        """-> Transferring, for callers that move the bytes themselves; Failed instead
        (write nothing then) if the room failed (an abort, a timeout, a receiver's
        engine lost its lease or restarted...) or a receiver vanished meanwhile.
        NotReadyError, with nothing written, before every required receiver has bound
        and published (poll until WaitingForInput)."""
        self._run(self.store.begin(self.room, self.engine, self._receivers()))
        if self._status == KVPoll.Bootstrapping:
            raise NotReadyError(
                f"room {self.room}: begin_transfer() before every required receiver bound "
                "and published its pages (status Bootstrapping); nothing written: poll "
                "until WaitingForInput, then begin"
            )
        return self._status

    @_call
    def finish_transfer(self) -> KVPoll:
        """-> Success; acks every receiver, which see Success on their next poll. Failed
        instead (with the recorded reason) if the room failed meanwhile, a receiver
        failed or vanished, or this engine's lease may have lapsed (design rule 3: one
        outcome per room). NotReadyError, with nothing written, before
        begin_transfer()."""
        self._run(self._finish_call(self._receivers()))
        if self._status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
            raise NotReadyError(
                f"room {self.room}: finish_transfer() before begin_transfer() (status "
                f"{self._status.name}); nothing written: call begin_transfer() first"
            )
        return self._status

    def _finish_call(self, receivers: list[str], lapsed: str | None = None) -> Call:
        """finish.lua, unless this engine's lease may have lapsed (a process stopped or
        cut off past its lease, whose peers may have failed the room): then the sender
        fails instead, and the room with it (the failure mark), never Success."""
        if lapsed is None:  # a batch asks once for all its rooms
            lapsed = self.mgr.lease_lapsed()
        if lapsed:
            return self.store.update(self.room, "tx", self.engine, KVPoll.Failed, lapsed)
        return self.store.finish(self.room, self.engine, receivers)

    @_call
    def send(self, kv_indices: object, last: bool = True) -> KVPoll:
        """Move these source pages to every receiver (the next slice of each receiver's
        destination pages), then record the state transition. Any transport or registry
        failure on the way aborts the room with the reason (returns Failed); a Redis
        error is raised as StateConnectionError after a best-effort abort."""
        src = as_indices(kv_indices)
        transport = self.mgr.transport
        if transport is None:
            raise KVStateError(
                f"room {self.room}: send() needs a transport, and this KVManager has none; "
                "move the bytes yourself between begin_transfer() and finish_transfer() "
                "(both record the state), or pass transport= to KVManager"
            )
        infos = self.transfer_infos()
        if self._status in (KVPoll.Failed, KVPoll.Success):
            return self._status
        if self._status < KVPoll.WaitingForInput or not infos:
            raise KVStateError(
                f"room {self.room}: send() before every receiver published its pages "
                f"(status {self._status.name}); poll until WaitingForInput first"
            )
        total = self._sent + len(src)
        if self._num_pages is not None and total > self._num_pages:
            raise InvalidIndicesError(
                f"room {self.room}: sending {total} pages, more than init() announced "
                f"({self._num_pages})"
            )
        try:  # the one failure boundary: every way out below leaves the room decided
            targets = self._targets(infos, len(src))
            if self._status != KVPoll.Transferring and self.begin_transfer() != KVPoll.Transferring:
                return self._status
            if targets:
                moved, t0 = transport.stats.bytes_moved, time.perf_counter()
                with paused():  # bounded by transfer_timeout, not by the call's Redis time
                    transport.write(self.room, src, targets, self.mgr.transfer_timeout)
                if self.mgr.recorder is not None:
                    self.mgr.recorder.observe(
                        transport.stats.bytes_moved - moved, time.perf_counter() - t0
                    )
        except (TransportError, InvalidIndicesError) as exc:
            # the whole room: receivers learn it on their next poll instead of
            # waiting out their timeout for pages that will not come
            self.abort(f"transfer failed: {exc}")
            return self._status
        except KVStateError as exc:
            try:
                self.abort(f"transfer failed: {exc}")
            except KVStateError as again:  # Redis is what failed: the abort may fail too
                log.warning("room %s: could not abort after %s: %s", self.room, exc, again)
            raise
        self._sent = total
        if last:
            self.finish_transfer()
        return self._status

    def _targets(self, infos: dict[str, TransferInfo], n: int) -> list[Target]:
        targets = []
        for info in infos.values():
            if info.dummy:
                continue
            dst = info.kv_indices[self._sent : self._sent + n]
            if len(dst) != n:
                raise InvalidIndicesError(
                    f"room {self.room}: receiver {info.receiver} published {len(info.kv_indices)} "
                    f"pages, fewer than the {self._sent + n} being sent"
                )
            peer = self.mgr.peer(info.receiver, info.incarnation)
            targets.append(Target(peer.endpoint, peer.layout, dst))
        return targets


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
    ) -> None:
        if required_senders is not None and (not is_int(required_senders) or required_senders < 1):
            raise InvalidValueError(
                f"required_senders must be an int >= 1, got {required_senders!r}"
            )
        if senders is not None and not senders:
            raise InvalidValueError("senders, when given, must name at least one prefill engine")
        self.bootstrap_addr = check_name(bootstrap_addr, "bootstrap_addr")
        self._explicit = senders
        self._required = required_senders or (len(senders) if senders else 0)  # 0: not known
        self._bound: dict[str, str] = {}  # sender engine -> incarnation bound to
        self._pending: tuple[dict[str, str], int] | None = None  # a binding in flight
        self._found: Status | None = None  # a lookup's answer, for the next _absorb
        self._lookup_out = False  # a lookup went out and its answer has not come back
        self._covered = False  # the binding in this batch published the payload to all
        self._payload = b""  # the transfer info, once init() made it
        super().__init__(mgr, room, self._required, {schema.PEER_ADDR: bootstrap_addr})

    @property
    def senders(self) -> list[str]:
        """The sender engines bound so far."""
        return sorted(self._bound)

    def _wanted(self) -> int:
        """How many senders to bind: the named ones, else the required count (0: ask)."""
        return len(self._explicit) if self._explicit else self._required

    def _create_calls(self, lookups: Lookups | None = None) -> list[Call]:
        calls = super()._create_calls()
        if calls:
            calls.append(self.store.track(self.bootstrap_addr, self.room, self.engine))
        bind = self._bind_call(lookups)
        return calls + [bind] if bind is not None else calls

    def _bind_call(self, lookups: Lookups | None = None) -> Call | None:
        """Bind the senders registered since the last look (and publish to them, once
        init() ran), or None when there is nothing to bind. By address on a standalone
        server, the script reads the registry's index itself (no read of its own);
        otherwise ``lookups`` shares one registry read per address among the receivers
        of one batch."""
        wanted = self._wanted()
        if (
            self._cleared
            or self._status in (KVPoll.Failed, KVPoll.Success)
            or (wanted and len(self._bound) >= wanted)
        ):
            return None
        if not self._explicit and not self.store.cluster:
            # the registry read folded into the binding (issue 22): publish.lua reads
            # the address's index itself, in this round trip, and answers whom it bound
            self.mgr.check_usable()
            self._covered = not self._bound
            self._lookup_out = True
            return replace(
                self.store.publish(
                    self.room,
                    self.engine,
                    dict(self._bound),
                    self._payload,
                    self._required,
                    self.bootstrap_addr,
                ),
                parse=self._looked_up,
            )
        found = self.mgr.prefill_engines(self.bootstrap_addr, self._explicit, lookups)
        required = self._required
        if not required and found:  # the group's declared size, or all of it that is up
            required = max(len(found), *(e.ranks for e in found))
        new = {e.engine: e.incarnation for e in found if e.engine not in self._bound}
        if not self._explicit:
            new = dict(sorted(new.items())[: max(required - len(self._bound), 0)])
        if not new and required == self._required:
            return None
        self._pending = (new, required)
        self._covered = not self._bound
        return self.store.publish(self.room, self.engine, new, self._payload, required)

    def _looked_up(self, raw: Any) -> Status:
        """A lookup binding's reply (parsed as it comes back): whom it bound, kept for
        the next ``_absorb``, which the batch's status reply reaches."""
        st = Status.parse_bound(raw)
        self._found, self._lookup_out = st, False
        return st

    def _answers_status(self, call: Call) -> bool:
        return call.parse == self._looked_up or super()._answers_status(call)

    def _batch(self, call: Call, lookups: Lookups | None = None) -> tuple[list[Call], int]:
        """As a participant's; an init's publish is left out when the binding ahead of
        it carries the same transfer info to every sender bound (none was before it):
        the one publish.lua call does both (issue 22)."""
        self._covered = False
        calls, at = super()._batch(call, lookups)
        if (
            self._covered
            and self._payload
            and call.script == "publish"
            and len(calls) > 1
            and calls[-1] is call
        ):
            calls.pop()
            at = len(calls) - 1
        return calls, at

    def _absorb(self, st: Status) -> Status:
        if self._pending is not None:  # the batch that carried the binding ran
            new, required = self._pending
            self._pending = None
            self._bound.update(new)
            self._required = required
            self.mgr.watch(self.bootstrap_addr, new)
        found, self._found = self._found, None
        if found is not None and found.bound is not None:  # a lookup ran
            self._bound.update(found.bound)
            if found.required > 0:
                self._required = found.required
            self.mgr.watch(self.bootstrap_addr, found.bound)
        return super()._absorb(st)

    def step_lost(self) -> None:
        """The batch that carried a binding did not run (or not whole): bind again on
        the next operation."""
        self._pending = None

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
            self.engine, idx, aux_index, state, prefix_len, dummy, self.mgr.incarnation
        )
        self._payload = info.encode()

    def _step_call(self, op: str, lapsed: str = "") -> Call:
        """The publish of ``init`` for a batch (KVManager.init_many)."""
        return self.store.publish(
            self.room, self.engine, dict(self._bound), self._payload, self._required
        )

    @_call
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
            self._run(
                self.store.publish(
                    self.room, self.engine, dict(self._bound), self._payload, self._required
                )
            )
        except KVStateError as exc:
            err = exc
            self._pending = None  # that batch did not run (or not whole): bind again later
            size = len(self._payload)
            oversize = size >= _MIN_BULK_LIMIT  # Redis hangs up on it: reads as "down"
            if oversize:
                self._payload = b""  # never to be sent again by a later binding
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

    def _clear_args(self) -> dict[str, Any]:
        senders = set(self._bound) | set(self._pending[0] if self._pending else {})
        if self._lookup_out:
            # a lookup's answer was lost: it may have bound (and published to) any
            # engine listed at the address; their xfer fields go too (one read, only
            # in this case; the fields expire with their key when it fails)
            try:
                found = self.mgr.prefill_engines(self.bootstrap_addr, None)
            except KVStateError as exc:
                log.warning("room %s: could not read %s: %s", self.room, self.bootstrap_addr, exc)
            else:
                senders |= {e.engine for e in found}
        return {"senders": sorted(senders), "peer_addr": self.bootstrap_addr}


__all__ = ["KVReceiver", "KVSender", "Participant"]
