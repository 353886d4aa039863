"""vLLM ranks for the integration tests: vLLM's own config, factory, Request and
KVCacheBlocks around kvstate's connector, in a spawned process (UCX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BLOCKS = 16
BLOCK_SHAPE = (4, 2, 8)  # tokens per block, heads, head size


def config(role: str, engine_id: str) -> Any:
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig

    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStateConnector",
            kv_connector_module_path="kvstate.integrations.vllm",
            kv_role=role,
            engine_id=engine_id,
        ),
    )


def connectors(role: str, engine_id: str) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = config(role, engine_id)
    return (
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None),
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None),
    )


def request(rid: str, params: dict[str, Any] | None, status: Any = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    req = Request(rid, list(range(12)), sp, None)
    if status is not None:
        req.status = status
    return req


def blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def caches(seed: int | None) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed or 0)
    out = {}
    for layer in range(2):
        shape = (2, BLOCKS, *BLOCK_SHAPE)
        out[f"layer{layer}"] = (
            torch.zeros(shape) if seed is None else torch.rand(shape, generator=gen)
        )
    return out


def step(conn: Any, meta: Any) -> tuple[Any, Any]:
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.wait_for_save()
    out = conn.get_finished(set())
    conn.clear_connector_metadata()
    return out


def flow(_index: int, url: str, out: str) -> None:
    """Prefill hands three requests to decode: one moves, one the decode aborts, one
    `kvstate abort` fails mid-way. Reports what each side's calls returned."""
    os.environ["KVSTATE_REDIS_URL"] = url
    from vllm.v1.request import RequestStatus

    p_sched, p_work = connectors("kv_producer", "prefill-a")
    d_sched, d_work = connectors("kv_consumer", "decode-b")
    p_kv, d_kv = caches(seed=7), caches(seed=None)
    p_work.register_kv_caches(p_kv)
    d_work.register_kv_caches(d_kv)
    res: dict[str, Any] = {}
    done = RequestStatus.FINISHED_LENGTH_CAPPED
    handoff = {}
    for rid, src in (("r-ok", [3, 4, 5]), ("r-abort", [6, 7, 8]), ("r-cli", [9, 10, 11])):
        delay, params = p_sched.request_finished(
            request(rid, {"do_remote_decode": True}, done), src
        )
        handoff[rid] = params
        res[f"{rid}-delay"] = delay
    # a request aborted on prefill hands nothing over
    res["aborted-on-prefill"] = p_sched.request_finished(
        request("r-x", {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED), [1]
    )
    res["p-first"] = [sorted(x or []) for x in step(p_work, p_sched.build_connector_meta(None))]
    # decode: two requests load, one is aborted while waiting for its KV
    dst = {"r-ok": [12, 13, 14], "r-abort": [0, 1, 2], "r-cli": [6, 7, 8]}
    for rid in ("r-ok", "r-cli"):
        req = request(f"d-{rid}", dict(handoff[rid]))
        res[f"{rid}-matched"] = list(d_sched.get_num_new_matched_tokens(req, 0))
        d_sched.update_state_after_alloc(req, blocks(dst[rid]), 12)
    res["d-first"] = [sorted(x or []) for x in step(d_work, d_sched.build_connector_meta(None))]
    aborted = request("d-r-abort", dict(handoff["r-abort"]), RequestStatus.FINISHED_ABORTED)
    res["d-abort"] = list(d_sched.request_finished(aborted, []))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstate.cli",
            "abort",
            str(handoff["r-cli"]["kvstate_room"]),
            "--reason",
            "operator",
        ],
        check=True,
        env=os.environ,
    )
    # prefill's next step: r-ok is pushed and done, r-abort and r-cli free their blocks
    res["p-second"] = [sorted(x or []) for x in step(p_work, p_sched.build_connector_meta(None))]
    res["d-second"] = [sorted(x or []) for x in step(d_work, d_sched.build_connector_meta(None))]
    res["load-errors"] = sorted(d_work.get_block_ids_with_load_errors())
    # the loaded request runs and finishes on decode later: nothing to abort then
    from vllm.v1.outputs import KVConnectorOutput

    d_sched.update_connector_output(KVConnectorOutput(finished_recving={"d-r-ok"}))
    finished = request(
        "d-r-ok", dict(handoff["r-ok"], do_remote_prefill=False), RequestStatus.FINISHED_STOPPED
    )
    res["d-ok-finished"] = list(d_sched.request_finished(finished, [12, 13, 14]))
    same = all(bool((p_kv[k][:, [3, 4, 5]] == d_kv[k][:, [12, 13, 14]]).all()) for k in p_kv)
    untouched = all(bool((d_kv[k][:, [6, 7, 8]] == 0).all()) for k in d_kv)
    res["bytes_equal"], res["cli_blocks_untouched"] = same, untouched
    p_work.shutdown()
    d_work.shutdown()
    Path(out, "vllm.json").write_text(json.dumps(res))
