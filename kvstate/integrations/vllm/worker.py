"""The connector's worker side: one TP rank's rooms and pages.

Each rank registers as its own kvstate engine (``vllm@<engine_id>.tp<rank>``, at the
address ``vllm@<engine_id>`` shared by the engine's ranks) with a lease on the Redis
clock. Rank *i* of the decode binds to rank *i* of the prefill: both engines must run
the same TP size (checked at start-up against the live engines of the other role, and
with every request through the KV cache signature).

Per step (``get_finished``, called once per step by vLLM's worker glue): one
``poll_many`` over every pending room of this rank, pages pushed into rooms whose
decode published, one ``clear_many`` for the rooms that concluded. A room kvstate
cannot read (listed in ``.errors`` for another reason than a connection) fails its
request alone.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvstate.errors import KVStateError, StateConnectionError, VLLMConfigError
from kvstate.integrations.vllm.layout import buffers, layout_name
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata
from kvstate.integrations.vllm.settings import Settings, rank_name
from kvstate.poll import KVPoll, PollResults
from kvstate.registry import Registry
from kvstate.roles import KVManager, KVReceiver, KVSender
from kvstate.store import Store, connect
from transports.base import Transport

log = logging.getLogger(__name__)
DONE = (KVPoll.Success, KVPoll.Failed)


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 outside a TP group)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


class WorkerSide:
    """One TP rank: registration, the rooms of its requests, the pages."""

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
        self.tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.rank = tp_rank()
        self.name = rank_name(engine, self.rank)
        self.store: Store | None = None
        self.mgr: KVManager | None = None
        self.transport: Transport | None = None
        self._sending: dict[str, tuple[KVSender, list[int]]] = {}
        self._loading: dict[str, tuple[KVReceiver, list[int]]] = {}
        self._refused: set[str] = set()  # loads that failed before their room existed
        self._load_errors: set[int] = set()
        self._unclear: set[int] = set()  # concluded rooms whose clear must be retried

    # -- start-up -------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Check the caches and the peers, register the pages, start the lease."""
        from transports.ucx import UCXTransport

        layout = layout_name(self.vllm_config, self.kv_cache_config)
        runs = buffers(kv_caches, self.kv_cache_config, layout)
        self.store = connect(self.settings.redis_url, self.settings.namespace)
        self._check_peers(self.store)
        transport = UCXTransport()
        try:
            transport.register_buffers([b.tensor for b in runs], [b.page_bytes for b in runs])
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
                ranks=self.tp,
            )
        except BaseException:
            transport.close()
            raise
        self.transport = transport
        log.info(
            "%s: %d KV runs registered (layout %s, %d blocks)",
            self.name,
            len(runs),
            layout,
            self.kv_cache_config.num_blocks,
        )

    def _check_peers(self, store: Store) -> None:
        """Refuse to start beside a live vLLM engine of the other role whose TP size
        differs: kvstate moves rank i's pages to rank i only."""
        other = "decode" if self.producer else "prefill"
        for info in Registry(store).all():
            if info.engine.startswith("vllm@") and info.role == other and info.ranks != self.tp:
                raise VLLMConfigError(
                    f"{self.name} runs tensor_parallel_size {self.tp}, but {other} engine "
                    f"{info.engine} (live in namespace {store.namespace!r}) runs "
                    f"{info.ranks}; kvstate moves rank i's blocks to rank i: start prefill "
                    "and decode engines with the same tensor_parallel_size"
                )

    # -- per step -------------------------------------------------------------------
    def start(self, meta: KVStateConnectorMetadata) -> None:
        """This step's new rooms: prefill senders hold their blocks, decode receivers
        publish theirs (one batch for the step)."""
        mgr = self.mgr
        if mgr is None:
            return
        for req_id, (room, blocks) in meta.send.items():
            self._sending[req_id] = (mgr.sender(room), blocks)
        pages: dict[object, object] = {}
        for req_id, (room, remote, blocks) in meta.recv.items():
            try:
                rcv = mgr.receiver(room, remote, senders=[rank_name(remote, self.rank)])
            except KVStateError as exc:
                log.warning("request %s: load refused: %s", req_id, exc)
                self._refused.add(req_id)
                self._load_errors.update(blocks)
                continue
            self._loading[req_id] = (rcv, blocks)
            pages[room] = np.asarray(blocks, dtype=np.int64)
        for req_id, reason in meta.abort.items():
            if req_id in self._loading:
                rcv = self._loading[req_id][0]
                try:
                    rcv.abort(reason)
                except KVStateError as exc:  # its timeouts stay the backstop
                    log.warning("room %s: abort failed: %s", rcv.room, exc)
        if pages:
            try:  # a room not published now is published by its next poll's binding
                mgr.init_many(pages)
            except KVStateError as exc:
                log.warning("%s: publishing %d room(s) failed: %s", self.name, len(pages), exc)

    def _poll(self, mgr: KVManager, rooms: list[int]) -> PollResults:
        """One batch; if the batch itself is refused (a room kvstate cannot read), each
        room alone, so that one bad room fails its own request only."""
        try:
            return mgr.poll_many(rooms)
        except StateConnectionError:
            raise
        except KVStateError as exc:
            log.warning("%s: batch poll refused (%s); polling rooms one by one", self.name, exc)
        out = PollResults()
        for room in rooms:
            try:
                out.update(mgr.poll_many([room]))
            except KVStateError as exc:
                out.errors[room] = exc
        return out

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks the prefill may free, requests whose load ended)."""
        mgr = self.mgr
        loaded, self._refused = self._refused, set()
        if mgr is None or not (self._sending or self._loading or self._unclear):
            return set(), loaded
        rooms = [s.room for s, _ in self._sending.values()]
        rooms += [r.room for r, _ in self._loading.values()]
        try:
            res = self._poll(mgr, rooms) if rooms else PollResults()
        except StateConnectionError as exc:  # Redis away: statuses stay, try next step
            log.warning("%s: poll failed: %s", self.name, exc)
            return set(), loaded
        bad = {r: e for r, e in res.errors.items() if not isinstance(e, StateConnectionError)}
        done: list[int] = []
        sent: set[str] = set()
        for req_id, (snd, blocks) in list(self._sending.items()):
            if snd.room in bad:
                self._give_up(snd, bad[snd.room])
            elif snd.status == KVPoll.WaitingForInput:
                self._send(snd, blocks)
            if snd.room in bad or snd.status in DONE:
                sent.add(req_id)
                done.append(snd.room)
                del self._sending[req_id]
        for req_id, (rcv, blocks) in list(self._loading.items()):
            if rcv.room in bad:
                self._give_up(rcv, bad[rcv.room])
            if rcv.room in bad or rcv.status in DONE:
                if rcv.room in bad or rcv.status == KVPoll.Failed:
                    self._load_errors.update(blocks)
                loaded.add(req_id)
                done.append(rcv.room)
                del self._loading[req_id]
        self._clear(mgr, done)
        return sent, loaded

    def _send(self, snd: KVSender, blocks: list[int]) -> None:
        """Push the request's pages (the tail the decode asked for: it may have the
        head cached); a failure fails the room, which send() records."""
        try:
            want = max((len(i.kv_indices) for i in snd.transfer_infos().values()), default=0)
            snd.send(np.asarray(blocks[len(blocks) - want :], dtype=np.int64))
        except StateConnectionError as exc:  # the room stays; the next step looks again
            log.warning("room %s: send interrupted: %s", snd.room, exc)
        except KVStateError as exc:  # e.g. a receiver's infos kvstate cannot read
            self._give_up(snd, exc)

    def _give_up(self, p: KVSender | KVReceiver, exc: KVStateError) -> None:
        log.warning("room %s: failing its request: %s", p.room, exc)
        try:
            assert self.store is not None
            self.store.abort(p.room, f"{self.name} cannot use this room: {exc}")
        except KVStateError as again:
            log.warning("room %s: abort failed: %s", p.room, again)

    def _clear(self, mgr: KVManager, rooms: list[int]) -> None:
        todo = rooms + sorted(self._unclear)
        if not todo:
            return
        try:
            self._unclear = set(mgr.clear_many(todo))
        except KVStateError as exc:
            log.warning("%s: clearing %d room(s) failed: %s", self.name, len(todo), exc)
            self._unclear = set(todo)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Fail and clear what this rank still holds (the other side learns it on its
        next poll), then drop the lease."""
        mgr = self.mgr
        if mgr is not None:
            live = [s for s, _ in self._sending.values()] + [r for r, _ in self._loading.values()]
            for p in live:
                try:
                    p.abort(f"engine {self.name} shut down")
                except KVStateError as exc:
                    log.warning("room %s: abort at shutdown failed: %s", p.room, exc)
            self._clear(mgr, [p.room for p in live])
            self._sending.clear()
            self._loading.clear()
            mgr.close()
        if self.transport is not None:
            self.transport.close()
        if self.store is not None:
            self.store.close()
        self.mgr = self.transport = self.store = None


__all__ = ["WorkerSide", "tp_rank"]
