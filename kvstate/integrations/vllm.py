"""kvstate as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded without a patch:

    --kv-transfer-config '{"kv_connector": "KVStateConnector",
        "kv_connector_module_path": "kvstate.integrations.vllm", "kv_role": "kv_producer",
        "engine_id": "prefill-a", "kv_connector_extra_config": {"redis_url": "redis://..."}}'

(the ``vllm.general_plugins`` entry point also registers the name, so the module path
may be left out). Prefill pushes: each request that finishes on the prefill engine with
``do_remote_decode`` becomes a kvstate room (id derived from the engine id and request
id) whose sender holds the request's blocks; the decode engine's worker publishes its
blocks into the room, the prefill worker writes its pages there through kvstate's
transport and concludes the room; both workers learn the outcome in ``get_finished``
from one ``poll_many`` per step. Room TTLs and engine leases run on the Redis clock (no
lease heartbeats between engines, no clock-offset estimate); a decode abort fails the
room, so the prefill frees its blocks on its next step (vllm#21570, #46283), and a
failed load reports its blocks through ``get_block_ids_with_load_errors``.

Limits: tensor parallel size 1 per engine, one KV cache group (no hybrid KV cache
manager: run with ``--disable-hybrid-kv-cache-manager``), KV caches whose blocks are
the outermost dimension of each K and V tensor (FlashAttention's
``[2, num_blocks, ...]`` layout).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvstate.defaults import LEASE
from kvstate.errors import KVStateError
from kvstate.keys import MAX_ROOM
from kvstate.manager import KVManager
from kvstate.poll import KVPoll
from kvstate.roles import KVReceiver, KVSender
from kvstate.store import Store, connect
from transports.base import Transport

log = logging.getLogger(__name__)

CONNECTOR = "KVStateConnector"


def room_of(engine_id: str, request_id: str) -> int:
    """A room id both engines derive from the prefill engine and its request id, so
    two requests never share one (a client cannot pick it)."""
    digest = hashlib.blake2b(f"{engine_id}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % MAX_ROOM


def engine_name(engine_id: str) -> str:
    return f"vllm@{engine_id}"


@dataclass
class KVStateConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: rooms to publish into, rooms to send, aborts."""

    recv: dict[str, tuple[int, str, list[int]]] = field(default_factory=dict)
    send: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


class KVStateConnector(KVConnectorBase_V1):
    """Scheduler side: which requests load or send, as rooms; worker side: the rooms
    themselves (kvstate participants) and the pages."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        tp = int(
            getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
        )
        if tp > 1:
            raise KVStateError(f"KVStateConnector supports tensor_parallel_size 1, got {tp}")
        if cfg.kv_role not in ("kv_producer", "kv_consumer"):
            raise KVStateError(
                f"KVStateConnector needs kv_role kv_producer (prefill) or "
                f"kv_consumer (decode), got {cfg.kv_role!r}"
            )
        self.engine_id = str(cfg.engine_id or "vllm")
        self.engine = engine_name(self.engine_id)
        self.producer = cfg.kv_role == "kv_producer"
        self._url = extra.get("redis_url") or os.environ.get("KVSTATE_REDIS_URL")
        self._namespace = extra.get("namespace") or os.environ.get("KVSTATE_NAMESPACE")
        self._lease = float(extra.get("lease", LEASE))
        self._store: Store | None = None
        # scheduler side
        self._recv: dict[str, tuple[int, str, list[int]]] = {}
        self._send: dict[str, tuple[int, list[int]]] = {}
        self._pending_loads: dict[str, int] = {}  # decode requests whose load is running
        # worker side
        self.mgr: KVManager | None = None
        self.transport: Transport | None = None
        self._sending: dict[str, tuple[KVSender, list[int]]] = {}
        self._loading: dict[str, tuple[KVReceiver, list[int]]] = {}
        self._load_errors: set[int] = set()
        self._refused: set[str] = set()  # loads that failed before a room existed

    def _state(self) -> Store:
        if self._store is None:
            self._store = connect(self._url, self._namespace)
        return self._store

    # -- scheduler side ------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or params.get("kvstate_room") is None:
            return 0, False
        count = max(len(request.prompt_token_ids) - num_computed_tokens, 0)
        return count, count > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or params.get("kvstate_room") is None:
            return
        ids = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        room = int(params["kvstate_room"])
        self._recv[request.request_id] = (room, str(params["remote_engine_id"]), ids)
        self._pending_loads[request.request_id] = room
        params["do_remote_prefill"] = False  # once per request

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads the workers concluded leave the scheduler's pending set."""
        for req_id in connector_output.finished_recving or ():
            self._pending_loads.pop(req_id, None)

    def build_connector_meta(self, scheduler_output: Any) -> KVStateConnectorMetadata:
        meta = KVStateConnectorMetadata(recv=self._recv, send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        room = params.get("kvstate_room")
        pending = self._pending_loads.pop(request.request_id, None)
        if room is not None and not params.get("do_remote_decode"):
            if pending is None and not params.get("do_remote_prefill"):
                return False, None  # its load concluded: the room is gone already
            # a decode request that ended before its load did (aborted): fail the room
            # so the prefill frees its blocks now
            try:
                self._state().abort(
                    int(room),
                    f"request {request.request_id} ended on decode engine {self.engine_id}",
                )
            except KVStateError as exc:
                log.warning("abort of room %s failed: %s", room, exc)
            return False, None
        if not params.get("do_remote_decode") or not self.producer:
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted on prefill: nothing to hand over
        room = room_of(self.engine_id, request.request_id)
        self._send[request.request_id] = (room, list(block_ids))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvstate_room": room,
            "remote_engine_id": self.engine,
        }

    # -- worker side ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register every layer's K and V block arrays; start the engine's lease."""
        from transports.ucx import UCXTransport

        buffers, page_bytes = [], []
        for tensor in kv_caches.values():
            for half in (tensor[0], tensor[1]):  # [2, num_blocks, ...]
                buffers.append(half)
                page_bytes.append(half[0].nbytes)
        self.transport = UCXTransport()
        self.transport.register_buffers(buffers, page_bytes)
        role = "prefill" if self.producer else "decode"
        self.mgr = KVManager(
            self._state(), role, self.engine, self.engine, self.transport, lease=self._lease
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Create this step's rooms: publish decode blocks, hold prefill blocks."""
        if not self.has_connector_metadata() or self.mgr is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStateConnectorMetadata)
        for req_id, (room, blocks) in meta.send.items():
            self._sending[req_id] = (self.mgr.sender(room), blocks)
        for req_id, (room, remote, blocks) in meta.recv.items():
            try:
                rcv = self.mgr.receiver(room, remote, senders=[remote])
                rcv.init(np.asarray(blocks, dtype=np.int64))
            except KVStateError as exc:  # e.g. the prefill engine is gone
                log.warning("request %s: load refused: %s", req_id, exc)
                self._load_errors.update(blocks)
                self._refused.add(req_id)
                continue
            self._loading[req_id] = (rcv, blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Pages arrive before the request is scheduled (asynchronous load)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Pages are pushed whole from ``get_finished`` once the decode published."""

    def wait_for_save(self) -> None:
        """Nothing is saved per layer."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """One poll_many for every pending room; push pages into rooms whose decode
        published; report rooms that concluded (Failed ones free blocks at once)."""
        if self.mgr is None or not (self._sending or self._loading or self._refused):
            return None, None
        rooms = [s.room for s, _ in self._sending.values()] + [
            r.room for r, _ in self._loading.values()
        ]
        try:
            if rooms:
                self.mgr.poll_many(rooms)
        except KVStateError as exc:
            log.warning("kvstate poll failed: %s", exc)
            return None, None
        sent: set[str] = set()
        for req_id, (snd, blocks) in list(self._sending.items()):
            if snd.status == KVPoll.WaitingForInput:
                infos = snd.transfer_infos()
                want = max((len(i.kv_indices) for i in infos.values()), default=0)
                try:
                    snd.send(np.asarray(blocks[len(blocks) - want :], dtype=np.int64))
                except KVStateError as exc:
                    snd.abort(f"send failed: {exc}")
            if snd.status in (KVPoll.Success, KVPoll.Failed):
                sent.add(req_id)
                snd.clear()
                del self._sending[req_id]
        loaded, self._refused = self._refused, set()
        for req_id, (rcv, blocks) in list(self._loading.items()):
            if rcv.status in (KVPoll.Success, KVPoll.Failed):
                if rcv.status == KVPoll.Failed:
                    self._load_errors.update(blocks)
                loaded.add(req_id)
                rcv.clear()
                del self._loading[req_id]
        return sent or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        if self.transport is not None:
            self.transport.close()


def plugin() -> None:
    """``vllm.general_plugins`` entry point: register the connector by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, __name__, CONNECTOR)


__all__ = ["CONNECTOR", "KVStateConnector", "KVStateConnectorMetadata", "plugin", "room_of"]
