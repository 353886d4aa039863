"""NixlConnector's worker side on this CPU host, where NIXL is installed
(``pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1`` in the vLLM venv): without
it the benchmark runs NIXL's scheduler side alone, as before.

vLLM's CPU platform is a build of its own (``vllm._C``, triton-cpu), not the wheel
the [vllm] extra installs, so NIXL's worker meets vLLM's "unspecified" platform and
refuses it. Here, only while a NIXL engine's scheduler and worker are made (its config
is made before, on the platform vLLM found), vLLM's ``CpuPlatform`` stands in: NIXL's
modules, imported then, keep it (its scheduler and worker agree: no host buffer, KV
caches registered as they lie); the attention kernel's block-size rule is not applied
(no kernel runs: the emulated forward samples a token per request); the CPU-affinity
NIXL gives its thread (one core per NUMA node for transfers) is undone, so both
connectors' hooks run on the same cores. What is timed is NIXL's own code; its
transfers are real (UCX, within this process)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from kvstate.testing.process import free_port

NIXL_MODULES = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def available() -> bool:
    return importlib.util.find_spec("nixl") is not None


@contextlib.contextmanager
def cpu_platform() -> Iterator[None]:
    """vLLM's CpuPlatform as the current platform for what is made inside; the one
    vLLM found again after."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    before = platforms.current_platform  # resolved now if it was not yet
    cpu = platforms._current_platform = CpuPlatform()  # what current_platform answers
    for name, module in list(sys.modules.items()):  # NIXL's modules imported already
        if name.startswith(NIXL_MODULES) and hasattr(module, "current_platform"):
            module.current_platform = cpu
    affinity = os.sched_getaffinity(0)
    try:
        yield
    finally:
        platforms._current_platform = before
        os.sched_setaffinity(0, affinity)


def one_rank() -> None:
    """vLLM's process groups for one rank (NIXL's worker asks them its TP rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        backend="gloo",
    )
    parallel_state.initialize_model_parallel(1, 1)


def worker(config: Any, worker_config: Any, caches: dict[str, Any]) -> Any:
    """NIXL's connector, worker role, its KV caches registered (inside cpu_platform)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    base_worker.select_common_block_size = lambda block_size, backends, specs: block_size
    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
    with set_current_vllm_config(config):
        one_rank()
        conn = NixlConnector(config, KVConnectorRole.WORKER, worker_config)
        conn.register_kv_caches(caches)
    return conn
