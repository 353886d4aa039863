"""kvstate as a vLLM v1 KV connector, driven by vLLM 0.34.0's own config, factory,
plugin loader, Request and KVCacheBlocks, with a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstate.errors import KVStateError
from kvstate.store import connect
from tests.helpers import keys_of

pytestmark = pytest.mark.vllm


def test_factory_loads_the_connector_by_module_path_and_by_plugin_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.plugins import load_general_plugins

    from kvstate.integrations.vllm import KVStateConnector
    from tests.integrations.vllm_rig import config

    cfg = config("kv_producer", "prefill-a")
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KVStateConnector
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    assert isinstance(conn, KVStateConnector) and conn.engine == "vllm@prefill-a"
    load_general_plugins()  # the vllm.general_plugins entry point registers the name
    by_name = KVTransferConfig(kv_connector="KVStateConnector", kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(by_name) is KVStateConnector
    with pytest.raises(KVStateError, match="kv_producer .prefill. or kv_consumer"):
        KVConnectorFactory.create_connector(config("kv_both", "x"), KVConnectorRole.WORKER, None)


def test_prefill_to_decode_moves_pages_and_aborts_free_blocks(
    redis_url: str, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    from tests.integrations.vllm_rig import flow

    ctx = mp.start_processes(
        flow, args=(redis_url, str(tmp_path)), nprocs=1, join=False, start_method="spawn"
    )
    ctx.join(timeout=240)
    res = json.loads((tmp_path / "vllm.json").read_text())
    assert res["r-ok-delay"] and res["r-abort-delay"]
    assert res["aborted-on-prefill"] == [False, None]
    assert res["p-first"] == [[], []]  # nothing concluded before decode published
    assert res["r-ok-matched"] == [12, True]
    assert res["d-first"] == [[], []]
    assert res["d-abort"] == [False, None]
    # prefill: r-ok pushed and done; r-abort (decode aborted) and r-cli (kvstate abort)
    # free their blocks at once instead of waiting out a lease
    assert res["p-second"] == [["r-abort", "r-cli", "r-ok"], []]
    # decode: both loads concluded; the failed one reports its blocks
    assert res["d-second"] == [[], ["d-r-cli", "d-r-ok"]]
    assert res["load-errors"] == [6, 7, 8]
    assert res["bytes_equal"] and res["cli_blocks_untouched"]
    assert res["d-ok-finished"] == [False, None]  # and no abort mark left (0 keys below)
    assert keys_of(connect(redis_url)) == []
