"""KVStateConnector: the ``KVConnectorBase_V1`` vLLM instantiates, once per scheduler
(role SCHEDULER) and once per worker (role WORKER); each call goes to that role's
half (scheduler.py, worker.py)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstate.errors import VLLMConfigError
from kvstate.integrations.vllm.metrics import KVStateConnectorStats, KVStatePromMetrics
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata, SchedulerSide
from kvstate.integrations.vllm.settings import Settings, engine_name
from kvstate.integrations.vllm.worker import WorkerSide, check_parallel


class KVStateConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstate rooms for vLLM's P/D disaggregation (kv_producer / kv_consumer). With
    ``SupportsHMA`` vLLM keeps its hybrid KV cache manager on: a request holds a block
    list per KV cache group, and each group's blocks a decode needs move (groups.py);
    a group kvstate cannot move refuses the engine at start-up."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        if cfg.kv_role not in ("kv_producer", "kv_consumer"):
            raise VLLMConfigError(
                f"KVStateConnector needs kv_role kv_producer (prefill) or "
                f"kv_consumer (decode), got {cfg.kv_role!r}"
            )
        settings = Settings.from_extra(cfg.kv_connector_extra_config)
        engine_id = str(cfg.engine_id or "vllm")
        self.engine = engine_name(engine_id)
        self.producer = cfg.kv_role == "kv_producer"
        check_parallel(vllm_config, self.producer)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                vllm_config, kv_cache_config, settings, self.engine, engine_id, self.producer
            )
        else:
            self._worker = WorkerSide(
                vllm_config, kv_cache_config, settings, self.engine, self.producer
            )

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """Workers register the KV cache with UCX: one physical allocation a segment."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS

    @property
    def sched(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side call on a worker connector"
        return self._sched

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    # -- scheduler side ------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self.sched.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self.sched.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: Any) -> KVStateConnectorMetadata:
        return self.sched.build_connector_meta()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's new rooms to the worker's run behind the step (worker.py)."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStateConnectorMetadata)
            self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before vLLM schedules the request (asynchronous loads)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Pages are pushed whole once the decode published, not per layer."""

    def wait_for_save(self) -> None:
        """Nothing is saved per step: blocks stay held until their room concludes."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, loaded = self.worker.finished()
        return sent or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished, and the loads that failed by request (a hybrid model's: vLLM
        cannot map failed blocks of several KV cache groups back to requests)."""
        sent, loaded = self.worker.finished()
        return KVConnectorTransferResults(sent, loaded, self.worker.failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    # -- stats (both sides: the scheduler counts its fallbacks) ----------------------
    def get_kv_connector_stats(self) -> KVStateConnectorStats | None:
        side = self._worker or self._sched
        return side.get_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStateConnectorStats:
        return KVStateConnectorStats(data=data) if data is not None else KVStateConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStatePromMetrics:
        return KVStatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()


__all__ = ["KVStateConnector"]
