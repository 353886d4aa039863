"""One vLLM 0.34 engine in this process: vLLM's own config, KV cache planning and v1
Scheduler, a connector's worker side beside it (kvstate's; NIXL's needs NIXL), and an
emulated forward that samples one token per scheduled request. Every connector hook
the scheduler and the worker call is timed, and the Redis round trips of each step are
counted (this thread's, at the socket: the KVManagers' heartbeat threads apart).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.roles.behind import THREAD_PREFIX
from kvstate.testing import RoundTrips
from kvstate.testing.process import free_port
from tools.bench.steps import nixl

HEADS, HEAD_SIZE, LAYERS = 4, 8, 2
BLOCK = 4  # tokens a block
PROMPT = 8  # tokens a prompt: two blocks
MAX_LEN = 128
#: the scheduler-side hooks vLLM 0.34's Scheduler calls (both connectors; each one the
#: connector has), and the worker-side ones (kvstate's)
SCHED_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "request_finished_all_groups",
    "update_connector_output",
    "on_new_request",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_kv_connector_stats",
    "take_events",
)
WORKER_HOOKS = ("start_load_kv", "get_finished")


def write_model(path: Path, layers: int = LAYERS) -> str:
    """A config.json vLLM's ModelConfig reads without a hub (no weights are loaded), of
    ``layers`` attention layers (each a KV cache the connectors register)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HEADS * HEAD_SIZE,
                "intermediate_size": 64,
                "num_attention_heads": HEADS,
                "num_key_value_heads": HEADS,
                "num_hidden_layers": layers,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
            }
        )
    )
    return str(path)


@dataclass(frozen=True)
class Spec:
    """One engine: its role, connector, and room for ``seqs`` requests at once."""

    role: str  # kv_producer | kv_consumer
    engine_id: str
    connector: str  # KVStateConnector | NixlConnector
    url: str
    model_dir: str
    seqs: int
    extra: tuple[tuple[str, Any], ...] = ()  # more kv_connector_extra_config (kvstate)

    def config(self) -> Any:
        os.environ["HF_HUB_OFFLINE"] = "1"
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        kvstate = self.connector == "KVStateConnector"
        return VllmConfig(
            model_config=ModelConfig(
                model=self.model_dir,
                skip_tokenizer_init=True,
                dtype="float16",
                max_model_len=MAX_LEN,
            ),
            cache_config=CacheConfig(
                block_size=BLOCK,
                enable_prefix_caching=False,
                num_gpu_blocks_override=4 * self.seqs + 64,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.seqs,
                max_num_batched_tokens=PROMPT * self.seqs + 64,
                max_model_len=MAX_LEN,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            parallel_config=ParallelConfig(),
            kv_transfer_config=KVTransferConfig(
                kv_connector=self.connector,
                kv_connector_module_path="kvstate.integrations.vllm" if kvstate else None,
                kv_role=self.role,
                engine_id=self.engine_id,
                kv_connector_extra_config={"redis_url": self.url, **dict(self.extra)}
                if kvstate
                else {},
                **({} if kvstate else {"kv_buffer_device": "cpu"}),  # NIXL: host memory
            ),
            device_config=DeviceConfig(device="cpu"),
        )


def plan(config: Any) -> tuple[Any, Any]:
    """vLLM's engine-core planning for one worker: the layers' specs, their groups, the
    cache sizes, the layout (the backends' choice); the scheduler's config beside it."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    register_all_kvcache_specs(config)
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    layers = config.model_config.hf_config.num_hidden_layers
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}]
    layout = resolve_kv_cache_layout(config, [["LBNHC", "LBHNC"]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(config, specs)
    worker = get_kv_cache_configs(config, specs, [1 << 30], groups)[0]
    worker.kv_cache_layout = layout.name
    sched = generate_scheduler_kv_cache_config([worker])
    sched.hash_block_size = worker.hash_block_size = BLOCK
    config.cache_config.num_gpu_blocks = sched.num_blocks
    return worker, sched


class Hooks:
    """Wall time and calls of a connector's hooks: each named method ``conn`` has is
    wrapped on the instance (the scheduler and the worker call them through it); a hook
    called from inside another (request_finished_all_groups -> request_finished) counts
    its time once, in the outer one."""

    def __init__(self, conn: Any, names: tuple[str, ...]) -> None:
        self.spent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.trips: Counter[str] = Counter()  # Redis round trips made inside each hook
        self.depth = 0
        for name in names:
            if hasattr(conn, name):
                setattr(conn, name, self._timed(name, getattr(conn, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            r0, t0 = RoundTrips.by_thread["MainThread"], time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.spent[name] += time.perf_counter() - t0
                    self.trips[name] += RoundTrips.by_thread["MainThread"] - r0
                self.calls[name] += 1

        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        out = dict(self.spent), dict(self.calls), {k: v for k, v in self.trips.items() if v}
        self.spent.clear()
        self.calls.clear()
        self.trips.clear()
        return out


def behind_trips(engine: str) -> int:
    """Round trips made so far by KVManagers' threads behind the steps (kvstate's
    worker's runs, ``run_behind``), of the ranks whose engine name starts with
    ``engine``: the engine's thread does not wait for them."""
    prefix = THREAD_PREFIX + engine
    return sum(n for t, n in RoundTrips.by_thread.items() if t.startswith(prefix))


@dataclass
class Step:
    """What one engine step cost: seconds, calls and round trips per hook; all the
    round trips of the engine's thread, and those made behind it meanwhile."""

    spent: dict[str, float]
    calls: dict[str, int]
    hook_trips: dict[str, int]
    trips: int
    scheduled: int
    # since the engine's last step (runs behind a step may end between two): round
    # trips made behind, bytes kvstate's transport moved (a push step's), seconds the
    # runs behind ran
    behind: int = 0
    moved: int = 0
    behind_s: float = 0.0


class Engine:
    """vLLM's Scheduler and, for kvstate, its worker-side connector (TP 1) in this
    process; ``step()`` is EngineCore.step() with an emulated forward: ``forward_s``
    of the engine's thread waiting without the GIL, as a worker waits for its device
    (0: none), between ``start_load_kv`` and ``get_finished``, where vLLM runs it."""

    forward_s = 0.0
    #: the forward and the gap after a step last until kvstate's run behind the step
    #: ended (``WorkerSide.idle``), as on a GPU: hand-ordered tests see each step's work
    wait_behind = False

    def __init__(self, spec: Spec) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.config = spec.config()
        worker_config, sched_config = plan(self.config)
        self.worker: Any = None
        with contextlib.ExitStack() as stack:
            if spec.connector == "KVStateConnector":
                self.worker = self._worker(
                    worker_config, KVConnectorRole.WORKER, set_current_vllm_config
                )
            else:  # NIXL's scheduler and worker agree on a CPU platform (nixl.py)
                stack.enter_context(nixl.cpu_platform())
                os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                if nixl.available():
                    caches = self._caches(worker_config)
                    self.worker = nixl.worker(self.config, worker_config, caches)
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=sched_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=BLOCK,
                hash_block_size=BLOCK,
                log_stats=False,
            )
            if spec.connector != "KVStateConnector" and self.worker is not None:
                # EngineCore's part: the scheduler serves its worker's NIXL metadata
                # on the side channel, where decode workers handshake
                meta = self.worker.get_handshake_metadata()
                self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.hooks = Hooks(self.scheduler.connector, SCHED_HOOKS)
        self.worker_hooks = Hooks(self.worker, WORKER_HOOKS) if self.worker else None
        self.params: dict[str, dict[str, Any]] = {}
        self.finished: set[str] = set()
        self.name = f"vllm@{spec.engine_id}."  # its ranks' engine names start so
        self._marked = self._marks()

    def _caches(self, worker_config: Any) -> dict[str, Any]:
        """The KV caches of one worker, allocated as vLLM does."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        record_kv_cache_layout(self.config.cache_config, worker_config.kv_cache_layout)
        with set_current_vllm_config(self.config):
            layout = KVCacheLayout[worker_config.kv_cache_layout]
            caches: dict[str, Any] = allocate_kv_cache(worker_config, torch.device("cpu"), layout)
        return caches

    def _worker(self, worker_config: Any, role: Any, current: Any) -> Any:
        """kvstate's connector, worker role, its KV caches registered."""
        from kvstate.integrations.vllm import KVStateConnector

        caches = self._caches(worker_config)
        with current(self.config):
            conn = KVStateConnector(self.config, role, worker_config)
            conn.register_kv_caches(caches)
        return conn

    def add(self, rid: str, max_tokens: int, params: dict[str, Any] | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": dict(params)} if params else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        prompt = [(hash(rid) + i * 17) % 997 for i in range(PROMPT)]
        self.scheduler.add_request(Request(rid, prompt, sp, None, block_hasher=self.hasher))

    def step(self) -> Step:
        """schedule -> the worker's hooks around an emulated forward -> update."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        before = RoundTrips.by_thread["MainThread"]
        so = self.scheduler.schedule()
        rids = list(so.num_scheduled_tokens)
        kv = KVConnectorOutput()
        if self.worker is not None:
            self.worker.bind_connector_metadata(so.kv_connector_metadata)
            self.worker.start_load_kv(None)
            if self.forward_s:
                time.sleep(self.forward_s)
            self._wait_behind()
            sent, loaded = self.worker.get_finished(so.finished_req_ids)
            kv.finished_sending, kv.finished_recving = sent, loaded
            kv.invalid_block_ids = self.worker.get_block_ids_with_load_errors()
            self.worker.clear_connector_metadata()
        out = ModelRunnerOutput(
            req_ids=rids, sampled_token_ids=[[1] for _ in rids], kv_connector_output=kv
        )
        for client in self.scheduler.update_from_output(so, out).values():
            for o in client.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
                if o.kv_transfer_params:
                    self.params[o.request_id] = o.kv_transfer_params
        trips = RoundTrips.by_thread["MainThread"] - before
        spent, calls, hook_trips = self.hooks.take()
        if self.worker_hooks is not None:
            w_spent, w_calls, w_trips = self.worker_hooks.take()
            spent |= w_spent
            calls |= w_calls
            hook_trips |= w_trips
        self._wait_behind()
        marks = self._marks()
        behind, moved, spent_behind = (a - b for a, b in zip(marks, self._marked, strict=True))
        self._marked = marks
        return Step(
            spent, calls, hook_trips, trips, len(rids), int(behind), int(moved), spent_behind
        )

    def _marks(self) -> tuple[float, float, float]:
        """What the runs behind this engine's steps did so far: round trips, bytes
        moved, seconds."""
        return float(behind_trips(self.name)), float(self._moved()), self._behind_s()

    def _side(self) -> Any:
        """kvstate's WorkerSide (None: NIXL's connector)."""
        from kvstate.integrations.vllm.worker import WorkerSide

        side = getattr(self.worker, "worker", None)
        return side if isinstance(side, WorkerSide) else None

    def _wait_behind(self) -> None:
        side = self._side()
        if self.wait_behind and side is not None and not side.idle(60.0):
            raise TimeoutError("kvstate's run behind the step outlasted 60 s")

    def _behind_s(self) -> float:
        """Seconds kvstate's runs behind the steps ran so far (0: NIXL's connector)."""
        side = self._side()
        return side.mgr.behind.spent if side is not None and side.mgr is not None else 0.0

    def _moved(self) -> int:
        """Bytes kvstate's transport moved so far (0: NIXL's connector)."""
        transport = getattr(self._side(), "transport", None)
        return int(transport.stats.bytes_moved) if transport is not None else 0

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.scheduler.shutdown()
