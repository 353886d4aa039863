"""kvstate as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded without a patch:

    --kv-transfer-config '{"kv_connector": "KVStateConnector",
        "kv_connector_module_path": "kvstate.integrations.vllm", "kv_role": "kv_producer",
        "engine_id": "prefill-a", "kv_connector_extra_config": {"redis_url": "redis://..."}}'

(the ``vllm.general_plugins`` entry point also registers the name, so the module path
may be left out). Tested with vLLM 0.34.0. The package, by concept:

- ``settings``: ``kv_connector_extra_config`` (Redis URL, namespace, lease and
  timeouts) and the names both engines derive (engines, ranks, rooms);
- ``layout``: which bytes of vLLM's KV cache are one block's and how a block splits
  into KV heads, checked against the ``KVCacheConfig`` at start-up;
- ``handoff``: what a prefill hands the decode with a request, whether the decode can
  take it, and which prefill workers each decode rank reads from (heterogeneous TP,
  MLA, pipeline stages);
- ``scheduler``: requests -> rooms, aborts and holds from the scheduler;
- ``worker``: one worker's rooms and pages;
- ``metrics``: ``KVConnectorStats`` and the ``vllm:kvstate_*`` Prometheus metrics;
- ``connector``: the class vLLM instantiates, dispatching to the two halves.
"""

from __future__ import annotations

from kvstate.errors import LayoutRefusedError, VLLMConfigError
from kvstate.integrations.vllm.connector import KVStateConnector
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata
from kvstate.integrations.vllm.settings import CONNECTOR, Settings, room_of

_registered = False


def plugin() -> None:
    """``vllm.general_plugins`` entry point: register the connector by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    global _registered
    if not _registered:  # the entry point may run more than once in a process
        KVConnectorFactory.register_connector(CONNECTOR, __name__, CONNECTOR)
        _registered = True


__all__ = [
    "CONNECTOR",
    "KVStateConnector",
    "KVStateConnectorMetadata",
    "LayoutRefusedError",
    "Settings",
    "VLLMConfigError",
    "plugin",
    "room_of",
]
