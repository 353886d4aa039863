"""A worker's rooms as the runs behind its steps see them (worker.py starts the runs:
``KVManager.run_behind``). Only a run touches them, and shutdown once the last run
ended, so they need no lock. A run: the rooms handed over made (prefill senders; decode
receivers, published in one batch), one ``poll_changed`` (the rooms of this rank that
may have moved: change notices, new rooms, the sweep), which on a prefill also begins
the rooms whose decode published (``begin=True``), then their pages pushed
(``send_many``: one pass per decode rank) and one ``finish_many``, which clears them in
its round trip (``clear=True``: the prefill lets go of a room whatever its outcome).
Other rooms that concluded are cleared with the next run's poll
(``clear_many(later=True)``), in its round trip, or at once when they were the last in
flight. A run looks only at the rooms the poll answered and the rooms this rank acted on
since the last run, so it costs the same at 1 room and at 256 while rooms wait. A room
kvstate cannot read (listed in ``.errors`` for another reason than a connection) fails
its request alone. What happened is counted for vLLM's stats (metrics.py), in the
run's ``Outcome``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvstate.errors import KVStateError, LayoutRefusedError, StateConnectionError
from kvstate.integrations.vllm.groups import flatten, split
from kvstate.integrations.vllm.handoff import KVFacts, plan
from kvstate.integrations.vllm.metrics import KVStateConnectorStats
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata
from kvstate.poll import KVPoll, PollResults
from kvstate.roles import KVManager, KVReceiver, KVSender

log = logging.getLogger(__name__)
DONE = (KVPoll.Success, KVPoll.Failed)


@dataclass
class Outcome:
    """What runs behind the steps concluded, reported by the next ``get_finished``."""

    sent: set[str] = field(default_factory=set)  # prefill: blocks to free
    loaded: set[str] = field(default_factory=set)  # decode: loads that ended
    load_errors: set[int] = field(default_factory=set)  # their blocks, where failed
    failed: set[str] = field(default_factory=set)  # or by request (several groups)
    stats: KVStateConnectorStats = field(default_factory=KVStateConnectorStats)

    def merge(self, other: Outcome) -> None:
        self.sent |= other.sent
        self.loaded |= other.loaded
        self.load_errors |= other.load_errors
        self.failed |= other.failed
        if not other.stats.is_empty():
            self.stats.aggregate(other.stats)


class Rooms:
    """One worker's requests in flight, by room, and what a run does with them."""

    def __init__(
        self,
        mgr: KVManager,
        facts: KVFacts,
        name: str,
        rank: int,
        by_request: bool,
    ) -> None:
        self.mgr, self.facts = mgr, facts
        self.name, self.rank = name, rank
        self.producer = mgr.side == "tx"
        # vLLM takes failed blocks from one KV cache group only; with several, a failed
        # load is reported by request (KVConnectorTransferResults.failed_recving)
        self.by_request = by_request
        self.sending: dict[str, tuple[KVSender, list[list[int]]]] = {}
        self.loading: dict[str, tuple[KVReceiver, list[int]]] = {}
        self.dropped: set[str] = set()  # loads the decode's own scheduler aborted
        self.reqs: dict[int, str] = {}  # room -> its request, sending or loading
        # rooms the next run looks at whatever its poll answers: acted on here since
        self.look: set[int] = set()
        self.written: dict[int, tuple[float, int]] = {}  # pushed, not finished: (s, bytes)

    def due(self) -> bool:
        """Whether a run would do anything: rooms to look at or finish, or a room in
        flight that may have moved, or clears (rooms that wait unchanged: no)."""
        if self.look or self.written:
            return True
        busy = self.sending or self.loading or self.mgr.clearing
        return bool(busy) and not self.mgr.nothing_due()

    def run(self, metas: list[KVStateConnectorMetadata]) -> Outcome:
        """The rooms handed over made, one poll, the push, the conclusions, the clears:
        what they concluded, for the next ``get_finished``."""
        out = Outcome()
        for meta in metas:
            self.begin(meta, out)
        if not (self.sending or self.loading or self.mgr.clearing):
            return out
        try:  # the clears of rooms concluded before ride this poll
            res = self._poll()
        except StateConnectionError as exc:  # Redis away: statuses stay, try next run
            log.warning("%s: poll failed: %s", self.name, exc)
            return out
        if not (res or res.errors or self.look or self.written):
            return out  # a waiting run: nothing moved
        bad = {r: e for r, e in res.errors.items() if not isinstance(e, StateConnectionError)}
        look, self.look = self.look | set(res) | set(bad), set()
        reqs = [self.reqs[r] for r in sorted(look) if r in self.reqs]
        done: list[int] = []
        unclear: list[int] = []  # of those, the rooms whose clear is still to make
        self._push([self.sending[q] for q in reqs if q in self.sending], bad, out)
        if bad:
            self._give_up({p: bad[p.room] for p in self._held(reqs) if p.room in bad})
        for req_id in reqs:
            if req_id not in self.sending:
                continue
            snd = self.sending[req_id][0]
            # cleared by its finish: concluded, even where the reply was lost
            if snd.room in bad or snd.status in DONE or snd.cleared:
                self.written.pop(snd.room, None)
                if snd.room in bad or snd.status == KVPoll.Failed:
                    self._count_failure(snd, out)
                out.sent.add(req_id)
                done.append(snd.room)
                if not snd.cleared:
                    unclear.append(snd.room)
                del self.sending[req_id]
            elif snd.status != KVPoll.Bootstrapping:  # to begin, push or finish
                self.look.add(snd.room)
        for req_id in reqs:
            if req_id not in self.loading:
                continue
            rcv, pages = self.loading[req_id]
            if rcv.room in bad or rcv.status in DONE:
                if rcv.room in bad or rcv.status == KVPoll.Failed:
                    self._fail_load(req_id, pages, out)
                    if req_id not in self.dropped:
                        out.stats.record("num_failed_transfers")
                self.dropped.discard(req_id)
                out.loaded.add(req_id)
                done.append(rcv.room)
                unclear.append(rcv.room)
                del self.loading[req_id]
        for room in done:
            del self.reqs[room]
        self._clear(unclear)
        return out

    def begin(self, meta: KVStateConnectorMetadata, out: Outcome) -> None:
        """A step's new rooms: prefill senders hold their blocks, decode receivers
        publish theirs (one batch for the step); its aborts."""
        for req_id, (room, blocks) in meta.send.items():
            snd = self.mgr.sender(
                room, required_receivers=None, trace_context=meta.traces.get(req_id)
            )
            self.sending[req_id] = (snd, blocks)
            self.reqs[snd.room] = req_id
        pages: dict[object, object] = {}
        for req_id, load in meta.recv.items():
            try:
                if load.refused:
                    raise LayoutRefusedError(load.refused)
                p = plan(load.remote, load.facts, self.facts, self.rank)
                rcv = self.mgr.receiver(
                    load.room,
                    load.remote,
                    senders=p.senders,
                    receivers_per_sender=p.per_sender,
                    trace_context=meta.traces.get(req_id),
                )
            except KVStateError as exc:
                log.warning("request %s: load refused: %s", req_id, exc)
                out.loaded.add(req_id)
                self._fail_load(req_id, load.blocks, out)
                continue
            self.loading[req_id] = (rcv, load.blocks)
            self.reqs[rcv.room] = req_id
            self.look.add(rcv.room)
            pages[load.room] = np.asarray(load.blocks, dtype=np.int64)
        aborts: dict[KVSender | KVReceiver, str] = {}
        for req_id, reason in meta.abort.items():
            if req_id in self.loading:
                self.dropped.add(req_id)
                rcv = self.loading[req_id][0]
                self.look.add(rcv.room)
                aborts[rcv] = reason
        self._abort(aborts, "aborting")
        if pages:
            try:  # a room not published now is published by its next poll's binding
                self.mgr.init_many(pages)
            except KVStateError as exc:
                log.warning("%s: publishing %d room(s) failed: %s", self.name, len(pages), exc)

    def _poll(self) -> PollResults:
        """One batch of the rooms that may have moved; if the batch itself is refused (a
        room kvstate cannot read), each room in flight alone, so that one bad room fails
        its own request only."""
        try:
            return self.mgr.poll_changed(begin=self.producer)
        except StateConnectionError:
            raise
        except KVStateError as exc:
            log.warning("%s: batch poll refused (%s); polling rooms one by one", self.name, exc)
        out = PollResults()
        for room in list(self.reqs):
            try:
                out.update(self.mgr.poll_many([room], begin=self.producer))
            except KVStateError as exc:
                out.errors[room] = exc
        return out

    def _clear(self, rooms: list[int]) -> None:
        """The rooms a run concluded (those its finish cleared are skipped): cleared
        with the next run's poll while this rank has rooms in flight (vLLM steps again
        for them), at once when they were its last (an idle engine is not stepped:
        their keys would wait for the next request); one that fails then rides the
        next batch."""
        if self.sending or self.loading:
            if rooms:
                self.mgr.clear_many(rooms, later=True)
            return
        if rooms or self.mgr.clearing:  # at once (this run is behind); failed ride later
            self.mgr.clear_many(rooms, wait=False)

    def _count_failure(self, snd: KVSender, out: Outcome) -> None:
        """A prefill room that failed: blocks freed because no decode came (its
        bootstrap timeout), or a send that failed (a decode that aborted its own
        request is neither)."""
        reason = snd.reason or ""
        if reason.startswith("bootstrap timeout"):
            out.stats.record("num_kv_expired_reqs")
        elif reason.startswith("transfer failed"):
            out.stats.record("num_failed_transfers")

    def _push(
        self,
        looked: list[tuple[KVSender, list[list[int]]]],
        bad: dict[int, KVStateError],
        out: Outcome,
    ) -> None:
        """The senders looked at whose decode published, as one batch: begun by the
        run's poll (or, answered WaitingForInput by an earlier call, by one
        ``begin_many``), their pages pushed together, one ``finish_many`` that clears
        the rooms it concludes (``clear=True``). Rooms an earlier run began but could
        not push (Redis lost mid-write: the pages are pushed again, the same bytes) or
        pushed but could not finish are taken up where they stopped."""
        live = [(s, b) for s, b in looked if s.room not in bad]
        ready = {s.room: (s, b) for s, b in live if s.status == KVPoll.WaitingForInput}
        unpushed = [
            (s, b)
            for s, b in live
            if s.status == KVPoll.Transferring and s.room not in self.written
        ]
        if ready:
            try:
                self.mgr.begin_many(list(ready))
            except StateConnectionError as exc:  # statuses stay: the next run begins them
                log.warning("%s: beginning %d room(s) failed: %s", self.name, len(ready), exc)
                ready = {}
        pushing = {
            snd.room: (snd, src)
            for snd, blocks in [*unpushed, *ready.values()]
            if snd.status == KVPoll.Transferring  # else failed meanwhile: write nothing
            and (src := self._source(snd, blocks)) is not None
        }
        if pushing:
            self._write(pushing)
        for snd, _ in looked:
            if snd.cleared:  # its finish ran with its clear, the reply lost: concluded
                self.written.pop(snd.room, None)
        if not self.written:
            return
        try:
            res = self.mgr.finish_many(sorted(self.written), clear=True)
        except StateConnectionError as exc:  # the rooms stay written: finished next run
            log.warning("%s: finishing %d room(s) failed: %s", self.name, len(self.written), exc)
            return
        for room, status in res.items():
            took, nbytes = self.written.pop(room, (0.0, 0))
            if status == KVPoll.Success and nbytes:  # a dummy route moves nothing
                out.stats.record_transfer(took, nbytes)

    def _source(self, snd: KVSender, blocks: list[list[int]]) -> np.ndarray | None:
        """The request's pages to push: of each KV cache group, the tail the decode
        asked for (it may have the head cached; groups.split reads how much of each
        group from the number of pages it published); None when there is none (the
        room is failed) or its infos could not be read (it stays)."""
        try:
            want = max((len(i.kv_indices) for i in snd.transfer_infos().values()), default=0)
            take = split([len(ids) for ids in blocks], want)
            if take is None:
                raise LayoutRefusedError(
                    f"the decode published {want} pages, which no tail of this prefill's "
                    f"KV cache groups' {[len(ids) for ids in blocks]} blocks makes"
                )
            return np.asarray(flatten(blocks, take), dtype=np.int64)
        except StateConnectionError as exc:  # the room stays; its timeouts stay the bound
            log.warning("room %s: send interrupted: %s", snd.room, exc)
        except KVStateError as exc:  # e.g. a receiver's infos kvstate cannot read
            self._give_up({snd: exc})
        return None

    def _write(self, pushing: dict[int, tuple[KVSender, np.ndarray]]) -> None:
        """Push the rooms' pages together (``send_many``: one pass per decode rank), to
        be finished with the step's batch; a room whose write failed is failed by it."""
        before = {room: snd.moved for room, (snd, _) in pushing.items()}
        t0 = time.perf_counter()
        res = self.mgr.send_many({room: src for room, (_, src) in pushing.items()})
        took = time.perf_counter() - t0
        failed: dict[KVSender | KVReceiver, KVStateError] = {}
        for room, exc in res.errors.items():
            if isinstance(exc, StateConnectionError):  # the room stays, to push again
                log.warning("room %s: send interrupted: %s", room, exc)
            else:
                failed[pushing[room][0]] = exc
        self._give_up(failed)
        for room, status in res.items():
            if status == KVPoll.Transferring:
                self.written[room] = (took, pushing[room][0].moved - before[room])

    def _held(self, reqs: list[str]) -> list[KVSender | KVReceiver]:
        """The participants of these requests that this rank still holds."""
        held: list[KVSender | KVReceiver] = []
        for req_id in reqs:
            if req_id in self.sending:
                held.append(self.sending[req_id][0])
            elif req_id in self.loading:
                held.append(self.loading[req_id][0])
        return held

    def _give_up(self, failed: Mapping[KVSender | KVReceiver, KVStateError]) -> None:
        """Fail these rooms' requests, each with why, in one batch."""
        for p, exc in failed.items():
            log.warning("room %s: failing its request: %s", p.room, exc)
        why = {p: f"{self.name} cannot use this room: {exc}" for p, exc in failed.items()}
        self._abort(why, "failing")

    def _abort(self, reasons: Mapping[KVSender | KVReceiver, str], what: str) -> None:
        """``abort_many`` of rooms this rank holds (those cleared meanwhile left out);
        what it could not abort is logged: their timeouts stay the backstop."""
        rooms: dict[object, str | None] = {
            p.room: why for p, why in reasons.items() if not p.cleared
        }
        if not rooms:
            return
        try:
            res = self.mgr.abort_many(rooms)
        except KVStateError as exc:
            log.warning("%s: %s %d room(s) failed: %s", self.name, what, len(rooms), exc)
            return
        for room, error in res.errors.items():
            log.warning("room %s: %s it failed: %s", room, what, error)

    def _fail_load(self, req_id: str, pages: list[int], out: Outcome) -> None:
        if self.by_request:
            out.failed.add(req_id)
        else:
            out.load_errors.update(pages)

    def shut(self, reason: str) -> None:
        """Fail and clear every room still held (the other side learns it on its next
        poll): the engine shuts down."""
        live = [s for s, _ in self.sending.values()] + [r for r, _ in self.loading.values()]
        live = [p for p in live if not p.cleared]
        # one batch: a stalled Redis bounds the shutdown once, not once per room
        self._abort(dict.fromkeys(live, reason), "aborting at shutdown")
        try:  # these and the clears still due
            self.mgr.clear_many([p.room for p in live])
        except KVStateError as exc:
            log.warning("%s: clearing at shutdown failed: %s", self.name, exc)
        self.sending.clear()
        self.loading.clear()
        self.reqs.clear()


__all__ = ["DONE", "Outcome", "Rooms"]
