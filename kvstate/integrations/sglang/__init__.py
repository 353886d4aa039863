"""kvstate as an SGLang PD-disaggregation transfer backend (``--disaggregation-transfer-backend
kvstate``), loaded through SGLang's ``sglang.srt.plugins`` entry point: no fork, no patch.

What changes against SGLang's own backends
    * Per-room state (status, reasons, transfer infos, prefix length, acks, aborts,
      peer bindings) lives in Redis, not in per-process dicts: an abort from either
      side, or from ``kvstate abort``, reaches the other side on its next poll.
    * Engines register in kvstate's registry with a lease instead of the bootstrap
      HTTP server and ``/health``; a decode rank fails the rooms of a prefill rank
      whose lease lapsed, with the reason.
    * KV pages, the aux/metadata slot and the state slots move through kvstate's
      transport (``transports.ucx``: CMA on one host, UCX otherwise), one transport
      per index space, published together as one layout.
    * A scheduler step's polls cost one ``poll_many`` per Redis node: the first poll
      of a step polls every live room of the rank, the others read that answer.

Settings (environment, read when the manager starts)
    ``KVSTATE_REDIS_URL``, ``KVSTATE_NAMESPACE``: the state store (kvstate's own).
    ``KVSTATE_SGLANG_HOST``: the host this prefill registers under; decode looks the
    prefill up by the ``bootstrap_host:bootstrap_port`` its requests carry, so it must
    be the same string (default: SGLang's ``--host`` unless it is 0.0.0.0, else the
    host's IP).  ``KVSTATE_SGLANG_MAX_ROOMS`` (default 65536): rooms a rank keeps at
    once; more are refused as Failed (a flood of injected rooms cannot grow state
    without bound; each room's keys also carry a TTL).  ``KVSTATE_SGLANG_LEASE``
    (seconds, default 10).  ``KVSTATE_SGLANG_MEMORY``: ``host`` or ``cuda`` for the KV
    pool (default: ``cuda`` when torch sees a GPU).
"""

from kvstate.errors import UnsupportedLayoutError
from kvstate.integrations.sglang.manager import KVStateKVManager
from kvstate.integrations.sglang.mirror import mirrored
from kvstate.integrations.sglang.participants import (
    KVStateBootstrapServer,
    KVStateKVReceiver,
    KVStateKVSender,
)
from kvstate.integrations.sglang.ranks import PrefillInfo, prefill_engine
from kvstate.integrations.sglang.spaces import Settings, Spaces, raw_buffer

__all__ = [
    "KVStateBootstrapServer",
    "KVStateKVManager",
    "KVStateKVReceiver",
    "KVStateKVSender",
    "PrefillInfo",
    "Settings",
    "Spaces",
    "UnsupportedLayoutError",
    "prefill_engine",
    "mirrored",
    "raw_buffer",
]
