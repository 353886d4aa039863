"""KVSender: the prefill side of one room. It waits for its receivers' transfer infos
(where to write), moves the pages through its rank's transport (``send``) or lets the
caller move them (``begin_transfer`` / ``finish_transfer``), and acks the receivers."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstate import schema
from kvstate.codec import TransferInfo, as_indices, is_int, unpack
from kvstate.errors import (
    CorruptStateError,
    InvalidIndicesError,
    InvalidValueError,
    KVStateError,
    NotReadyError,
)
from kvstate.keys import Side
from kvstate.poll import KVPoll, PollResults
from kvstate.roles.contract import Bound, Lookups, Rank, StepInput
from kvstate.roles.participant import Participant, abort_many, participant_call
from kvstate.store import Call, Status, paused
from transports.base import Heads, Target, TransportError

log = logging.getLogger(__name__)


class KVSender(Participant):
    """The prefill side of a room."""

    side: Side = "tx"

    def __init__(
        self,
        mgr: Rank,
        room: object,
        required_receivers: int | None = 1,
        trace_context: str | None = None,
    ) -> None:
        if required_receivers is not None and (
            not is_int(required_receivers) or required_receivers < 1
        ):
            raise InvalidValueError(
                f"required_receivers must be an int >= 1 or None (as many as the "
                f"receivers declare), got {required_receivers!r}"
            )
        super().__init__(mgr, room, required_receivers or 0, {}, trace_context)
        # None: the receivers declare how many they are (kvstate.tp: a decode of another
        # TP size); learned from their infos when they published before this existed
        self._counted = required_receivers is not None
        self._declared = 0
        self._infos: dict[str, bytes] = {}
        self._infos_version = -1  # poll.lua returns the infos only when this is stale
        self._decoded: dict[str, TransferInfo] | None = None
        self._incarnations: tuple[dict[str, bytes], dict[str, str]] | None = None
        self._num_pages: int | None = None
        self._sent = 0
        self._moved = 0  # bytes its sends wrote
        self._peer_failed = False  # the heartbeat failed it: a receiver's engine died

    def _poll_call(self, begin: bool = False) -> Call:
        declared = 0 if self._counted else self._declared
        return self.store.poll(
            self.room,
            "tx",
            self.engine,
            with_infos=True,
            infos_version=self._infos_version,
            declared=declared,
            begin=begin,
        )

    @property
    def waiting(self) -> bool:
        """As a participant's, and no count learned from the infos still to write (its
        next poll carries it: poll.lua's ARGV[5])."""
        return super().waiting and (self._counted or not self._declared)

    def _absorb(self, st: Status) -> Bound | None:
        if st.version >= 0:
            self._infos_version = st.version
            if st.infos != self._infos:
                self._infos, self._decoded = st.infos, None
        bound = super()._absorb(st)
        if not self._counted:
            if self._status != KVPoll.Bootstrapping:
                self._counted = True  # Redis holds the count now
            elif self._infos:
                self._declared = self._count_declared()
        return bound

    def _count_declared(self) -> int:
        """The receivers this sender waits for, as its infos declare it (0: none do)."""
        key = self.store.keys.room_hash(self.room)
        wants = set()
        for receiver, raw in self._infos.items():
            want = unpack(raw, key, schema.xfer_field(self.engine, receiver)).get("want", 0)
            wants.add(want if is_int(want) and want > 0 else 0)
        if len(wants) > 1:
            log.warning(
                "room %s: receivers of %s declare different counts %s; waiting for the largest",
                self.room,
                self.engine,
                sorted(wants),
            )
        return max(wants)

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

    def _clear_args(self, lookups: Lookups | None) -> dict[str, list[str]]:
        # the infos it read go with it; one published since goes with its receiver
        return {"receivers": sorted(self._infos)}

    def peer_died(self) -> None:
        """The heartbeat failed this sender (a receiver's engine died): once is enough,
        its next poll reads Failed."""
        self._peer_failed = True

    @participant_call
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

    def _step_call(self, step: StepInput) -> Call:
        """begin or finish for a batch (KVManager.begin_many / finish_many), with the
        receivers of the last poll; a poll while none has published yet."""
        if not self._infos:
            return self._poll_call()
        receivers = list(self._infos)
        if step.op == "begin":
            return self.store.begin(self.room, self.engine, receivers)
        return self._finish_call(receivers, step.lapsed)

    def _receivers(self) -> list[str]:
        """The receivers that published to this sender (polling once if none has yet):
        their names only, without decoding the infos' page indices (send() does)."""
        if not self._infos and not self._cleared:
            self.poll()
        return list(self._infos)

    @participant_call
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

    @participant_call
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

    @participant_call
    def send(self, kv_indices: object, last: bool = True) -> KVPoll:
        """Move these source pages to every receiver (the next slice of each receiver's
        destination pages), then record the state transition. Any transport or registry
        failure on the way aborts the room with the reason (returns Failed); a Redis
        error is raised as StateConnectionError after a best-effort abort."""
        job = self._send_job(kv_indices)
        if job is not None:
            errors = _send([job], last)
            if self.room in errors:
                raise errors[self.room]
        return self._status

    @property
    def moved(self) -> int:
        """Bytes its sends wrote so far, to every receiver."""
        return self._moved

    def _send_job(self, kv_indices: object) -> _Send | None:
        """send()'s checks, raising what it refuses (nothing written); None once the
        room concluded (its status says how)."""
        src = as_indices(kv_indices)
        if self.mgr.transport is None:
            raise KVStateError(
                f"room {self.room}: send() needs a transport, and this KVManager has none; "
                "move the bytes yourself between begin_transfer() and finish_transfer() "
                "(both record the state), or pass transport= to KVManager"
            )
        infos = self.transfer_infos()
        if self._status in (KVPoll.Failed, KVPoll.Success):
            return None
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
        return _Send(self, src, total)

    def _begin_send(self, job: _Send) -> bool:
        """Where ``job``'s pages go, and the room Transferring; False when it failed
        meanwhile (write nothing then)."""
        job.targets = self._targets(self.transfer_infos(), len(job.src))
        return self._status == KVPoll.Transferring or self.begin_transfer() == KVPoll.Transferring

    def _sent_ok(self, job: _Send, moved: int, last: bool) -> None:
        self._sent = job.total
        self._moved += moved
        if last:
            self.finish_transfer()

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
            heads = None if info.heads is None else Heads(*info.heads)
            targets.append(Target(peer.endpoint, peer.layout, dst, heads))
        return targets


@dataclass
class _Send:
    """One room's part of a send: its sender, its source pages, the pages it will have
    sent once they land, and where they go (read when it begins)."""

    sender: KVSender
    src: np.ndarray
    total: int
    targets: list[Target] = field(default_factory=list)


def send_many(items: Sequence[tuple[KVSender, object]], last: bool = False) -> PollResults:
    """``send(pages, last)`` of senders of one rank, their pages written together
    (``Transport.write_many``: one pass per receiver). Each room answers what its
    ``send()`` returns; a room ``send()`` would refuse (nothing written for it), or
    whose send raised, is in ``.errors`` with that error."""
    jobs, errors = [], {}
    for snd, pages in items:
        try:
            job = snd._send_job(pages)
        except KVStateError as exc:
            errors[snd.room] = exc
            continue
        if job is not None:
            jobs.append(job)
    errors.update(_send(jobs, last))
    return PollResults(((s.room, s.status) for s, _ in items if s.room not in errors), errors)


def _send(jobs: list[_Send], last: bool) -> dict[int, KVStateError]:
    """Each job begun, the pages of those still live written together, and each room
    then decided: sent (and finished if ``last``), or failed with why. The one failure
    boundary of a send: answers the rooms whose Redis calls raised (to be raised)."""
    errors: dict[int, KVStateError] = {}
    ready = []
    failing: dict[KVSender, TransportError | KVStateError] = {}
    for job in jobs:
        try:
            if job.sender._begin_send(job):
                ready.append(job)
        except (TransportError, KVStateError) as exc:
            failing[job.sender] = exc
    errors.update(_give_up(failing))
    writing = [j for j in ready if j.targets]
    outcomes: dict[int, int | TransportError] = {}
    took = 0.0
    if writing:
        mgr = writing[0].sender.mgr
        assert mgr.transport is not None  # checked by _send_job
        t0 = time.perf_counter()
        with paused():  # bounded by transfer_timeout, not by the call's Redis time
            outcomes = mgr.transport.write_many(
                [(j.sender.room, j.src, j.targets) for j in writing], mgr.transfer_timeout
            )
        took = time.perf_counter() - t0
    failing = {}
    for job in ready:
        snd, outcome = job.sender, outcomes.get(job.sender.room, 0)
        try:
            if isinstance(outcome, TransportError):
                failing[snd] = outcome
                continue
            if job.targets and snd.mgr.recorder is not None:
                snd.mgr.recorder.observe(outcome, took)
            snd._sent_ok(job, outcome, last)
        except KVStateError as exc:
            errors[snd.room] = exc
    errors.update(_give_up(failing))
    return errors


def _give_up(failing: Mapping[KVSender, TransportError | KVStateError]) -> dict[int, KVStateError]:
    """The rooms fail with why their send did, in one batch (their receivers learn it
    on their next poll instead of waiting out their timeout for pages that will not
    come). What the caller raises per room, if anything: a Redis error that stopped
    its send (after a best-effort abort), or the abort's own after a failed transfer."""
    if not failing:
        return {}
    try:
        unaborted = abort_many({s: f"transfer failed: {exc}" for s, exc in failing.items()})
    except KVStateError as none_answered:
        unaborted = dict.fromkeys((s.room for s in failing), none_answered)
    out: dict[int, KVStateError] = {}
    for snd, exc in failing.items():
        refused = unaborted.get(snd.room)
        if isinstance(exc, TransportError | InvalidIndicesError):
            if refused is not None:
                out[snd.room] = refused
            continue
        if refused is not None:
            log.warning("room %s: could not abort after %s: %s", snd.room, exc, refused)
        out[snd.room] = exc
    return out


__all__ = ["KVSender", "send_many"]
