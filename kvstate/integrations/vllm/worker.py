"""The connector's worker side: one rank's rooms and pages.

Each worker registers as its own kvstate engine (``vllm@<engine_id>.tp<rank>``, or
``.pp<stage>.tp<rank>`` on a pipeline-parallel prefill, at the address
``vllm@<engine_id>`` shared by the engine's workers) with a lease on the Redis clock,
and its KV buffers with their ``Geometry`` (names, heads per page: layout.py). A decode
rank's receiver reads from the prefill workers ``kvstate.tp`` routes it to (handoff.py:
every head it holds from one prefill rank, on every pipeline stage; prefill ranks no
decode rank reads from get a dummy route), and declares how many decode ranks each
serves; a prefill worker's sender waits for as many (``required_receivers=None``).

Per step (``get_finished``, called once per step by vLLM's worker glue): one
``poll_changed`` (the rooms of this rank that may have moved: change notices, new rooms,
the sweep), which on a prefill also begins the rooms whose decode published
(``begin=True``), then their pages pushed and one ``finish_many``, which clears them in
its round trip (``clear=True``: the prefill lets go of a room whatever its outcome) and
runs behind the step (``wait=False``: the decode sees Success as soon as Redis ran it;
the prefill reads the outcome, and frees the blocks, next step). Other rooms that
concluded are cleared with the next step's poll (``clear_many(later=True)``), in its
round trip, or at once, behind the step, when they were the last in flight. A step looks
only at the rooms those answered and the rooms this rank acted on since its last step.
So a step waits for no round trip and costs the same at 1 room and at 256 while rooms
wait, and for one when rooms are admitted, conclude or are pushed (begun by the poll
before the pages are written; finished and cleared behind the step after). A room
kvstate cannot read (listed in ``.errors`` for another reason than a connection) fails
its request alone. What happened is counted for vLLM's stats (metrics.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvstate.errors import (
    KVStateError,
    LayoutRefusedError,
    StateConnectionError,
    VLLMConfigError,
)
from kvstate.integrations.vllm.groups import flatten, groups_of, split
from kvstate.integrations.vllm.handoff import KVFacts, plan
from kvstate.integrations.vllm.layout import BLOCK_OUTER, buffers, layout_name
from kvstate.integrations.vllm.metrics import KVStateConnectorStats
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata
from kvstate.integrations.vllm.settings import Settings, rank_name
from kvstate.poll import KVPoll, PollResults
from kvstate.roles import KVManager, KVReceiver, KVSender
from kvstate.store import Store, connect
from transports.base import Transport

log = logging.getLogger(__name__)
DONE = (KVPoll.Success, KVPoll.Failed)


def parallel_ranks() -> tuple[int, int]:
    """This process's (tensor-parallel rank, pipeline stage): (0, 0) outside groups."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return int(ps.get_tensor_model_parallel_rank()), int(ps.get_pp_group().rank_in_group)
    return 0, 0


def check_parallel(vllm_config: Any, producer: bool) -> None:
    """Refuse at start-up what kvstate does not move: a pipeline-parallel decode (a
    prefill writes each of its layers into one decode worker per TP rank; NixlConnector
    refuses it too)."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp > 1 and not producer:
        raise VLLMConfigError(
            f"pipeline_parallel_size {pp} on a decode (kv_consumer) engine: KVStateConnector "
            "moves a prefill's KV into one decode worker per TP rank holding every layer; "
            "run the decode with pipeline_parallel_size 1 (a prefill may use pipeline "
            "parallelism)"
        )


class WorkerSide:
    """One worker: registration, the rooms of its requests, the pages."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: Settings,
        engine: str,
        producer: bool,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.engine = engine
        self.producer = producer
        parallel = vllm_config.parallel_config
        self.tp = int(parallel.tensor_parallel_size)
        self.pp = int(parallel.pipeline_parallel_size)
        self.rank, self.stage = parallel_ranks()
        self.name = rank_name(engine, self.rank, self.stage, self.pp)
        self.facts: KVFacts | None = None
        self.stats = KVStateConnectorStats()
        self.store: Store | None = None
        self.mgr: KVManager | None = None
        self.transport: Transport | None = None
        self._sending: dict[str, tuple[KVSender, list[list[int]]]] = {}
        self._loading: dict[str, tuple[KVReceiver, list[int]]] = {}
        self._refused: set[str] = set()  # loads that failed before their room existed
        self._dropped: set[str] = set()  # loads the decode's own scheduler aborted
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()  # loads that failed, by request
        # vLLM takes failed blocks from one KV cache group only; with several, a failed
        # load is reported by request (KVConnectorTransferResults.failed_recving)
        self.by_request = kv_cache_config is not None and len(groups_of(kv_cache_config)) > 1
        self._reqs: dict[int, str] = {}  # room -> its request, sending or loading
        # rooms the next step looks at whatever its poll answers: acted on here since
        self._look: set[int] = set()
        self._written: dict[int, tuple[float, int]] = {}  # pushed, not finished: (s, bytes)
        self._finishing: Future[PollResults] | None = None  # the last push's, behind

    # -- start-up -------------------------------------------------------------------
    def _check_device(self, kv_caches: dict[str, Any]) -> None:
        """``kv_buffer_device`` must name the device the KV cache lives on: kvstate moves
        it from there (UCX registers device memory), it never stages it through host
        buffers, so another value is refused rather than ignored."""
        asked = str(getattr(self.vllm_config.kv_transfer_config, "kv_buffer_device", "") or "")
        devices = sorted({str(t.device.type) for t in kv_caches.values()})
        if asked and devices != [asked]:
            raise VLLMConfigError(
                f"kv_buffer_device={asked!r}, but the KV cache is on {'/'.join(devices)}: "
                "KVStateConnector moves the KV cache where it lives (its UCX transport "
                "registers device memory) and does not stage it through host buffers; "
                f"leave kv_buffer_device unset or set it to {devices[0]!r}"
            )

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Check the caches, register the pages with their geometry, start the lease."""
        from transports.ucx import UCXTransport

        self._check_device(kv_caches)
        layout = layout_name(self.vllm_config, self.kv_cache_config)
        if self.pp > 1 and layout in BLOCK_OUTER:
            raise VLLMConfigError(
                f"pipeline_parallel_size {self.pp} with KV cache layout {layout}: a block "
                "there holds every layer of a stage in one run, which cannot meet the "
                "decode's layers by name; use a layer-outer layout (LBHNC, LBNHC)"
            )
        runs = buffers(kv_caches, self.kv_cache_config, layout)
        self.facts = KVFacts.of(self.vllm_config, self.kv_cache_config)
        self.store = connect(self.settings.redis_url, self.settings.namespace)
        transport = UCXTransport()
        try:
            transport.register_buffers(
                [b.tensor for b in runs], [b.page_bytes for b in runs], [b.geometry for b in runs]
            )
            s = self.settings
            self.mgr = KVManager(
                self.store,
                "prefill" if self.producer else "decode",
                self.name,
                self.engine,
                transport,
                lease=s.lease,
                bootstrap_timeout=s.bootstrap_timeout,
                waiting_timeout=s.waiting_timeout,
                transfer_timeout=s.transfer_timeout,
                ranks=self.tp * self.pp,
            )
        except BaseException:
            transport.close()
            raise
        self.transport = transport
        g = runs[0].geometry
        log.info(
            "%s: %d KV runs registered (layout %s, %d blocks, %s heads x %s a page)",
            self.name,
            len(runs),
            layout,
            self.kv_cache_config.num_blocks,
            g.heads or "whole",
            g.outer,
        )

    # -- per step -------------------------------------------------------------------
    def start(self, meta: KVStateConnectorMetadata) -> None:
        """This step's new rooms: prefill senders hold their blocks, decode receivers
        publish theirs (one batch for the step)."""
        mgr = self.mgr
        if mgr is None or not (meta.send or meta.recv or meta.abort):
            return  # most steps: nothing new
        for req_id, (room, blocks) in meta.send.items():
            snd = mgr.sender(room, required_receivers=None, trace_context=meta.traces.get(req_id))
            self._sending[req_id] = (snd, blocks)
            self._reqs[snd.room] = req_id
        pages: dict[object, object] = {}
        for req_id, load in meta.recv.items():
            try:
                assert self.facts is not None
                if load.refused:
                    raise LayoutRefusedError(load.refused)
                p = plan(load.remote, load.facts, self.facts, self.rank)
                rcv = mgr.receiver(
                    load.room,
                    load.remote,
                    senders=p.senders,
                    receivers_per_sender=p.per_sender,
                    trace_context=meta.traces.get(req_id),
                )
            except KVStateError as exc:
                log.warning("request %s: load refused: %s", req_id, exc)
                self._refused.add(req_id)
                self._fail_load(req_id, load.blocks)
                continue
            self._loading[req_id] = (rcv, load.blocks)
            self._reqs[rcv.room] = req_id
            self._look.add(rcv.room)
            pages[load.room] = np.asarray(load.blocks, dtype=np.int64)
        for req_id, reason in meta.abort.items():
            if req_id in self._loading:
                self._dropped.add(req_id)
                rcv = self._loading[req_id][0]
                self._look.add(rcv.room)
                try:
                    rcv.abort(reason)
                except KVStateError as exc:  # its timeouts stay the backstop
                    log.warning("room %s: abort failed: %s", rcv.room, exc)
        if pages:
            try:  # a room not published now is published by its next poll's binding
                mgr.init_many(pages)
            except KVStateError as exc:
                log.warning("%s: publishing %d room(s) failed: %s", self.name, len(pages), exc)

    def _poll(self, mgr: KVManager) -> PollResults:
        """One batch of the rooms that may have moved; if the batch itself is refused (a
        room kvstate cannot read), each room in flight alone, so that one bad room fails
        its own request only."""
        try:
            return mgr.poll_changed(begin=self.producer)
        except StateConnectionError:
            raise
        except KVStateError as exc:
            log.warning("%s: batch poll refused (%s); polling rooms one by one", self.name, exc)
        out = PollResults()
        for room in list(self._reqs):
            try:
                out.update(mgr.poll_many([room], begin=self.producer))
            except KVStateError as exc:
                out.errors[room] = exc
        return out

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks the prefill may free, requests whose load ended)."""
        mgr = self.mgr
        loaded, self._refused = self._refused, set()
        if mgr is None:
            return set(), loaded
        self._read_finish()
        if not (self._sending or self._loading or mgr.clearing):
            return set(), loaded
        try:  # the clears of rooms concluded before ride this poll
            res = self._poll(mgr)
        except StateConnectionError as exc:  # Redis away: statuses stay, try next step
            log.warning("%s: poll failed: %s", self.name, exc)
            return set(), loaded
        if not (res or res.errors or self._look or self._written):
            return set(), loaded  # a waiting step: nothing moved
        bad = {r: e for r, e in res.errors.items() if not isinstance(e, StateConnectionError)}
        look, self._look = self._look | set(res) | set(bad), set()
        reqs = [self._reqs[r] for r in sorted(look) if r in self._reqs]
        done: list[int] = []
        unclear: list[int] = []  # of those, the rooms whose clear is still to make
        sent: set[str] = set()
        self._push(mgr, [self._sending[q] for q in reqs if q in self._sending], bad)
        behind = set(self._written) if self._finishing is not None else set()
        for req_id in reqs:
            if req_id not in self._sending:
                continue
            snd = self._sending[req_id][0]
            if snd.room in bad:
                self._give_up(snd, bad[snd.room])
            elif snd.room in behind:  # finishing behind the step: its outcome next step
                self._look.add(snd.room)
                continue
            # cleared by its finish: concluded, even where the reply was lost
            if snd.room in bad or snd.status in DONE or snd.cleared:
                self._written.pop(snd.room, None)
                if snd.room in bad or snd.status == KVPoll.Failed:
                    self._count_failure(snd)
                sent.add(req_id)
                done.append(snd.room)
                if not snd.cleared:
                    unclear.append(snd.room)
                del self._sending[req_id]
            elif snd.status != KVPoll.Bootstrapping:  # to begin, push or finish
                self._look.add(snd.room)
        for req_id in reqs:
            if req_id not in self._loading:
                continue
            rcv, pages = self._loading[req_id]
            if rcv.room in bad:
                self._give_up(rcv, bad[rcv.room])
            if rcv.room in bad or rcv.status in DONE:
                if rcv.room in bad or rcv.status == KVPoll.Failed:
                    self._fail_load(req_id, pages)
                    if req_id not in self._dropped:
                        self.stats.record("num_failed_transfers")
                self._dropped.discard(req_id)
                loaded.add(req_id)
                done.append(rcv.room)
                unclear.append(rcv.room)
                del self._loading[req_id]
        for room in done:
            del self._reqs[room]
        self._clear(mgr, unclear)
        return sent, loaded

    def _read_finish(self) -> None:
        """The outcome of the last push's ``finish_many``, which ran behind the step
        since (its rooms are looked at this step): each room it answered leaves
        ``_written``, its transfer counted; where the batch did not reach Redis the
        rooms stay written and are finished again this step."""
        running, self._finishing = self._finishing, None
        if running is None:
            return
        try:
            res = running.result()
        except StateConnectionError as exc:
            log.warning("%s: finishing %d room(s) failed: %s", self.name, len(self._written), exc)
            return
        for room, status in res.items():
            took, nbytes = self._written.pop(room, (0.0, 0))  # or concluded as bad since
            if status == KVPoll.Success and nbytes:  # a dummy route moves nothing
                self.stats.record_transfer(took, nbytes)

    def _clear(self, mgr: KVManager, rooms: list[int]) -> None:
        """The rooms a step concluded (those its finish cleared are skipped): cleared
        with the next step's poll while this rank has rooms in flight (vLLM steps again
        for them), at once, behind the step, when they were its last (an idle engine is
        not stepped: their keys would wait for the next request); one that fails then
        rides the next step's batch."""
        if self._sending or self._loading:
            if rooms:  # (a call waits for a finish running behind: none without rooms)
                mgr.clear_many(rooms, later=True)
            return
        if rooms or mgr.clearing:  # behind the step; those not cleared ride the next batch
            mgr.clear_many(rooms, wait=False)

    def _count_failure(self, snd: KVSender) -> None:
        """A prefill room that failed: blocks freed because no decode came (its
        bootstrap timeout), or a send that failed (a decode that aborted its own
        request is neither)."""
        reason = snd.reason or ""
        if reason.startswith("bootstrap timeout"):
            self.stats.record("num_kv_expired_reqs")
        elif reason.startswith("transfer failed"):
            self.stats.record("num_failed_transfers")

    def _push(
        self,
        mgr: KVManager,
        looked: list[tuple[KVSender, list[list[int]]]],
        bad: dict[int, KVStateError],
    ) -> None:
        """The senders looked at whose decode published, as one batch: begun by the
        step's poll (or, answered WaitingForInput by an earlier call, by one
        ``begin_many``), each room's pages pushed, one ``finish_many`` that clears the
        rooms it concludes (``clear=True``), run behind the step (``wait=False``: its
        outcome is read next step, ``_read_finish``). Rooms an earlier step began but
        could not push (Redis lost mid-write: the pages are pushed again, the same
        bytes) or pushed but could not finish are taken up where they stopped."""
        live = [(s, b) for s, b in looked if s.room not in bad]
        ready = {s.room: (s, b) for s, b in live if s.status == KVPoll.WaitingForInput}
        unpushed = [
            (s, b)
            for s, b in live
            if s.status == KVPoll.Transferring and s.room not in self._written
        ]
        if ready:
            try:
                mgr.begin_many(list(ready))
            except StateConnectionError as exc:  # statuses stay: the next step begins them
                log.warning("%s: beginning %d room(s) failed: %s", self.name, len(ready), exc)
                ready = {}
        pushing = {
            snd.room: (snd, src)
            for snd, blocks in [*unpushed, *ready.values()]
            if snd.status == KVPoll.Transferring  # else failed meanwhile: write nothing
            and (src := self._source(snd, blocks)) is not None
        }
        if pushing:
            self._write(mgr, pushing)
        for snd, _ in looked:
            if snd.cleared:  # its finish ran with its clear, the reply lost: concluded
                self._written.pop(snd.room, None)
        if self._written:
            self._finishing = mgr.finish_many(sorted(self._written), clear=True, wait=False)

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
            self._give_up(snd, exc)
        return None

    def _write(self, mgr: KVManager, pushing: dict[int, tuple[KVSender, np.ndarray]]) -> None:
        """Push the rooms' pages together (``send_many``: one pass per decode rank), to
        be finished with the step's batch; a room whose write failed is failed by it."""
        before = {room: snd.moved for room, (snd, _) in pushing.items()}
        t0 = time.perf_counter()
        res = mgr.send_many({room: src for room, (_, src) in pushing.items()})
        took = time.perf_counter() - t0
        for room, exc in res.errors.items():
            if isinstance(exc, StateConnectionError):  # the room stays, to push again
                log.warning("room %s: send interrupted: %s", room, exc)
            else:
                self._give_up(pushing[room][0], exc)
        for room, status in res.items():
            if status == KVPoll.Transferring:
                self._written[room] = (took, pushing[room][0].moved - before[room])

    def _give_up(self, p: KVSender | KVReceiver, exc: KVStateError) -> None:
        log.warning("room %s: failing its request: %s", p.room, exc)
        try:
            assert self.store is not None
            self.store.abort(p.room, f"{self.name} cannot use this room: {exc}")
        except KVStateError as again:
            log.warning("room %s: abort failed: %s", p.room, again)

    def _fail_load(self, req_id: str, pages: list[int]) -> None:
        if self.by_request:
            self._failed.add(req_id)
        else:
            self._load_errors.update(pages)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def failed_loads(self) -> set[str]:
        """Requests whose load failed (hybrid models), reported with their finish."""
        failed, self._failed = self._failed, set()
        return failed

    def get_stats(self) -> KVStateConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        """Fail and clear what this rank still holds (the other side learns it on its
        next poll), then drop the lease."""
        mgr = self.mgr
        if mgr is not None:
            self._read_finish()  # a finish behind: its rooms may be cleared now
            live = [s for s, _ in self._sending.values()] + [r for r, _ in self._loading.values()]
            live = [p for p in live if not p.cleared]
            for p in live:
                try:
                    p.abort(f"engine {self.name} shut down")
                except KVStateError as exc:
                    log.warning("room %s: abort at shutdown failed: %s", p.room, exc)
            try:  # these and the clears still due
                mgr.clear_many([p.room for p in live])
            except KVStateError as exc:
                log.warning("%s: clearing at shutdown failed: %s", self.name, exc)
            self._sending.clear()
            self._loading.clear()
            self._reqs.clear()
            mgr.close()
        if self.transport is not None:
            self.transport.close()
        if self.store is not None:
            self.store.close()
        self.mgr = self.transport = self.store = None


__all__ = ["WorkerSide", "check_parallel", "parallel_ranks"]
