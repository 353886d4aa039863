"""A vLLM 0.34 engine on CPU, built from vLLM's own parts: its VllmConfig, its KV
cache planning (layout resolution, get_kv_cache_configs), its v1 Scheduler with its KV
cache manager and block pool, and per worker (TP rank x pipeline stage) a process that
runs vLLM's distributed init on gloo (across the data-parallel engines too, when there
are several), its KV transfer group, ``allocate_kv_cache`` and the CPU model runner's
KV connector glue. Only the forward pass is emulated (vllm_model.py).

The test process holds the schedulers (one ``Engine`` per vLLM engine) and acts as the
router; each step is EngineCore.step(): schedule -> every rank's worker -> vLLM's
KVOutputAggregator -> update_from_output.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integrations import vllm_hybrid

HEADS, HEAD_SIZE, LAYERS = 4, 8, 2
ALL_LAYOUTS = ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"]
PRELOAD = [
    "torch",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.v1.worker.cpu.kv_connector",
    "vllm.v1.worker.utils",
    "kvstate.integrations.vllm",
    "transports.ucx",
    "tests.integrations.vllm_model",
]
READY_TIMEOUT = 180.0  # s: a worker's start-up (imports torch and vLLM)
BEHIND_TIMEOUT = 60.0  # s: kvstate's run behind a step (bounded by its own deadlines)
MAX_LEN = 128  # tokens: the longest request (blocks x block_size must cover it)


@dataclass
class Spec:
    """One engine: role, connector, parallelism and the cache geometry."""

    role: str  # kv_producer | kv_consumer
    engine_id: str
    url: str
    model_dir: str
    tp: int = 1
    pp: int = 1
    dp: int = 1  # data-parallel engines of this deployment (dp_configs)
    layout: str | None = None  # VLLM_KV_CACHE_LAYOUT; None: the backends' choice
    mla: bool = False
    blocks: int = 48
    block_size: int = 4
    chunk: int = 64  # max_num_batched_tokens
    max_seqs: int = 8
    inflight_loads: int | None = None  # max_num_inflight_kv_loads
    prefix_caching: bool = True
    policy: str = "recompute"  # kv_load_failure_policy
    connector: str = "KVStateConnector"
    kv_buffer_device: str | None = None
    hybrid: bool = False  # the model's layer_types (vllm_hybrid.py): the hybrid manager on
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def kv_heads(self) -> int:
        """The model's KV heads (its config.json)."""
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return int(cfg["num_key_value_heads"])

    @property
    def layers(self) -> list[str]:
        if self.hybrid:
            kinds = vllm_hybrid.layer_types(self.model_dir)
            return [vllm_hybrid.layer_name(k, i) for i, k in enumerate(kinds)]
        return [layer_name(i) for i in range(LAYERS)]

    def stage_layers(self, stage: int) -> list[int]:
        """The layers pipeline stage ``stage`` holds (vLLM's own partition)."""
        from vllm.distributed.utils import get_pp_indices

        lo, hi = get_pp_indices(LAYERS, stage, self.pp)
        return list(range(lo, hi))

    def heads(self, rank: int) -> list[int]:
        """The global KV heads TP rank ``rank`` holds (MLA: the one latent)."""
        if self.mla:
            return [0]
        n = self.kv_heads
        first = rank * n // self.tp
        return [first + k for k in range(max(1, n // self.tp))]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def prompt(seed: int, n: int) -> list[int]:
    """A test prompt: n token ids, different for each seed."""
    return [(seed * 131 + i * 17) % 997 for i in range(n)]


def module_redis(tmp_path_factory: Any) -> Iterator[str]:
    """A Redis of the test module's own (the ``url`` fixture): engines live across its
    tests, and the session server's per-test flush would drop their registrations."""
    from kvstate.testing.process import RedisProcess

    proc = RedisProcess(tmp_path_factory.mktemp("vredis"))
    proc.start()
    yield proc.unix_url
    proc.stop()


def write_model(path: Path, kv_heads: int = HEADS, hybrid: str = "") -> str:
    """A config.json vLLM's ModelConfig reads without a hub (no weights are loaded):
    ``kv_heads`` below HEADS is GQA; ``hybrid`` 'swa' or 'mamba' a hybrid model."""
    if hybrid:
        return vllm_hybrid.write_hybrid(path, hybrid, HEADS, HEAD_SIZE, LAYERS)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HEADS * HEAD_SIZE,
                "intermediate_size": 64,
                "num_attention_heads": HEADS,
                "num_key_value_heads": kv_heads,
                "num_hidden_layers": LAYERS,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
            }
        )
    )
    return str(path)


def vllm_config(spec: Spec) -> Any:
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

    extra = dict(spec.extra)
    module = None
    if spec.connector == "KVStateConnector":
        extra.setdefault("redis_url", spec.url)
        module = "kvstate.integrations.vllm"
    model = ModelConfig(
        model=spec.model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=MAX_LEN
    )
    buffer = {} if spec.kv_buffer_device is None else {"kv_buffer_device": spec.kv_buffer_device}
    dp = {}
    if spec.dp > 1:
        dp = {"data_parallel_size": spec.dp, "data_parallel_master_ip": "127.0.0.1"}
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(
            block_size=spec.block_size,
            enable_prefix_caching=spec.prefix_caching,
            num_gpu_blocks_override=spec.blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_seqs,
            max_num_inflight_kv_loads=spec.inflight_loads,
            max_num_batched_tokens=spec.chunk,
            max_model_len=MAX_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=spec.tp, pipeline_parallel_size=spec.pp, **dp
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=spec.connector,
            kv_connector_module_path=module,
            kv_role=spec.role,
            engine_id=spec.engine_id,
            kv_connector_extra_config=extra,
            kv_load_failure_policy=spec.policy,  # type: ignore[arg-type]
            **buffer,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    if spec.hybrid:
        vllm_hybrid.hma_on(config)
    return config


def dp_configs(spec: Spec) -> list[Any]:
    """One config per data-parallel engine, as vLLM makes them: copies of the one
    config (the rendezvous ports it picked included), each with its rank and its
    KV connector engine_id suffixed ``_dp<rank>``."""
    import copy

    from vllm.v1.engine.utils import _apply_dp_identity_suffix

    base = vllm_config(spec)
    out = []
    for rank in range(spec.dp):
        config = copy.deepcopy(base)
        config.parallel_config.data_parallel_rank = rank
        config.parallel_config.data_parallel_rank_local = rank
        _apply_dp_identity_suffix(config, rank)
        out.append(config)
    return out


def layer_specs(spec: Spec, stage: int = 0, config: Any = None) -> dict[str, Any]:
    """What the model's attention layers report on one worker of pipeline stage
    ``stage`` (heads split over TP, replicated when fewer than the ranks; an MLA latent
    is one head, replicated)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if spec.mla:
        one = MLAAttentionSpec(
            block_size=spec.block_size, num_kv_heads=1, head_size=24, dtype=torch.float16
        )
    else:
        one = FullAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=len(spec.heads(0)),
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
    if spec.hybrid:
        return vllm_hybrid.specs(spec.model_dir, config, spec.stage_layers(stage), one)
    return {layer_name(i): one for i in spec.stage_layers(stage)}


def plan(spec: Spec, config: Any) -> tuple[list[Any], Any]:
    """vLLM's engine-core planning: resolve the layout (VLLM_KV_CACHE_LAYOUT, else the
    connector's, else the backends'), group the layers, size the caches."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(config)
    specs = [layer_specs(spec, rank // spec.tp, config) for rank in range(spec.world)]
    saved = os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    if spec.layout:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = spec.layout
    try:  # the backends on this rank accept any layout (as FlexAttention's does)
        layout = resolve_kv_cache_layout(
            config, [ALL_LAYOUTS] * spec.world, [s for one in specs for s in one.values()]
        )
    finally:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        if saved is not None:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = saved
    groups = get_global_kv_cache_groups(config, specs)
    memory = 1 << 30
    configs = get_kv_cache_configs(config, specs, [memory] * spec.world, groups)
    for c in configs:
        c.kv_cache_layout = layout.name
    sched = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = sched.num_blocks
    return configs, sched


def worker_main(
    spec: Spec, config: Any, kv_cache_config: Any, rank: int, rendezvous: str, conn: Any
) -> None:
    """One worker (world rank ``rank``: TP rank ``rank % tp`` of stage ``rank // tp``):
    vLLM's distributed init (gloo), KV transfer group, allocation and connector glue;
    then scheduler outputs in, model runner outputs out."""
    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized,
            ensure_kv_transfer_shutdown,
        )
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.cpu.kv_connector import get_kv_connector
        from vllm.v1.worker.utils import allocate_kv_cache

        from tests.integrations.vllm_model import Model

        record_kv_cache_layout(config.cache_config, kv_cache_config.kv_cache_layout)
        with set_current_vllm_config(config):
            ps.init_distributed_environment(
                world_size=spec.world,
                rank=rank,
                distributed_init_method=rendezvous,
                local_rank=rank,
                backend="gloo",
            )
            ps.ensure_model_parallel_initialized(spec.tp, spec.pp)
            layout = KVCacheLayout[kv_cache_config.kv_cache_layout]
            caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
            glue = None  # another connector's worker side (NIXL's needs NIXL): not run
            if spec.connector == "KVStateConnector":
                ensure_kv_transfer_initialized(config, kv_cache_config)
                glue = get_kv_connector(config, caches)
        stage_layers = spec.stage_layers(rank // spec.tp)
        layers = None
        if spec.hybrid:
            layers = vllm_hybrid.model_layers(spec.model_dir, kv_cache_config, stage_layers)
        model = Model(caches, stage_layers, spec.block_size, spec.heads(rank % spec.tp), layers)
        groups = [g.cpu_group for g in (ps.get_tp_group(), ps.get_pp_group()) if g.world_size > 1]

        def all_ok(flags: list[bool]) -> list[bool]:
            """Every worker of this engine agrees (TP, then pipeline stages)."""
            t = torch.tensor([0 if f else 1 for f in flags], dtype=torch.int64)
            for group in groups:
                torch.distributed.all_reduce(t, group=group)
            return [int(v) == 0 for v in t.tolist()]

        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg, so = conn.recv()
        if msg == "stop":
            with set_current_vllm_config(config):
                ensure_kv_transfer_shutdown()
                ps.destroy_model_parallel()  # its groups' shared memory too
                ps.destroy_distributed_environment()
            conn.send(("bye", None))
            return
        try:
            with set_current_vllm_config(config):
                if glue is None:
                    rids, sampled = model.forward(so, all_ok)
                    out = ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled)
                elif so.total_num_scheduled_tokens == 0:
                    out = glue.no_forward(so)
                else:
                    glue.pre_forward(so)
                    rids, sampled = model.forward(so, all_ok)
                    behind_step()  # the forward lasts as long as the run behind it
                    glue.finish_forward()
                    out = ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled)
                    out.kv_connector_output = glue.post_forward(so.finished_req_ids)
                if glue is not None:
                    behind_step()  # and the step's gap: the run get_finished started
            report = (model.bytes_verified, list(model.mismatches))
            model.mismatches.clear()
            conn.send(("out", (out, report)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return


def behind_step() -> None:
    """Wait for kvstate's run behind the step (``WorkerSide.idle``), as a GPU forward
    and the gap between steps outlast it: the hand-ordered steps of these tests then see
    a step's rooms made, aborted or pushed when it returns (their outcome reported by
    the next step's ``get_finished``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "worker", None)
    if worker is not None and not worker.idle(BEHIND_TIMEOUT):
        raise TimeoutError(f"kvstate's run behind the step outlasted {BEHIND_TIMEOUT} s")


class WorkerDied(RuntimeError):
    pass


class Workers:
    """An engine's workers, one spawned process each (vLLM's multiproc executor's job)."""

    def __init__(self, spec: Spec, config: Any, configs: list[Any]) -> None:
        ctx = mp.get_context("forkserver")  # ranks fork from one process that imported vLLM
        ctx.set_forkserver_preload(PRELOAD)
        rendezvous = f"file://{tempfile.mkdtemp(prefix='vllm-rig-')}/gloo"
        self.conns, self.procs = [], []
        for rank in range(spec.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main,
                args=(spec, config, configs[rank], rank, rendezvous, child),
                daemon=True,
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def ready(self) -> None:
        """Wait for every rank's start-up (register_kv_caches included)."""
        for rank, conn in enumerate(self.conns):
            self._recv(rank, conn, READY_TIMEOUT)

    def _recv(self, rank: int, conn: Any, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise WorkerDied(f"rank {rank}: no answer in {timeout} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise WorkerDied(f"rank {rank} exited") from None
        if kind == "error":
            raise WorkerDied(f"rank {rank}:\n{value}")
        return value

    def run(self, so: Any) -> list[Any]:
        for conn in self.conns:
            conn.send(("step", so))
        return [self._recv(r, c, 120.0) for r, c in enumerate(self.conns)]

    def kill(self) -> None:
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(10)

    def stop(self) -> None:
        for r, conn in enumerate(self.conns):
            try:
                conn.send(("stop", None))
                self._recv(r, conn, 30.0)
            except (WorkerDied, OSError):
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
