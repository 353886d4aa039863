"""What kvstate's SGLang backend refuses when its manager starts, each with the option
that asks for it and what to do instead: never a setting silently run without."""

from __future__ import annotations

import os
from typing import Any

from kvstate.errors import UnsupportedLayoutError


def _on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# SGLang 0.5.23's state types whose indices list items (pages, slots, rows) of their
# buffers, moved item for item as the KV pages are (Mooncake's generic path, and its
# Mamba path at equal TP); others, e.g. dsa_tail (a 6-number descriptor of a ring's live
# range) or a hardware backend's own, would move the wrong bytes as item lists
SLOT_STATES = frozenset(
    {
        "mamba",
        "swa",
        "swa_ring",
        "dsa",
        "qsa_pending",
        "qsa_compressed",
        "c128_state",
        "request_row",
        "block_scale",
        "block_scale_swa",
        "minimax_index_k",
        "minimax_dense_kv",
    }
)


def refuse_unsupported(
    server_args: Any, kv_args: Any, role: str, pp_size: int, moves: bool = True
) -> None:
    """UnsupportedLayoutError naming the option, for what this backend cannot serve
    (``moves`` False: mirror mode, where another backend moves the state)."""
    for st in (getattr(kv_args, "state_types", None) or []) if moves else []:
        kind = str(getattr(st, "value", st))
        if kind not in SLOT_STATES:
            raise UnsupportedLayoutError(
                f"state type {kind!r}: its state indices are not a list of the state "
                "buffers' items (pages, slots, rows), which is all kvstate's backend "
                "moves; use SGLang's mooncake or nixl backend for this model"
            )
    if role == "decode" and pp_size > 1:
        raise UnsupportedLayoutError(
            f"a decode with pipeline parallel size {pp_size} (--pp-size): SGLang's decode "
            "runs pp_size 1 with every backend; run the decode with --pp-size 1"
        )
    if role == "prefill" and pp_size > 1:
        # each stage's KV buffers are named by the layers they hold (shape.buffer_names)
        if int(getattr(kv_args, "num_draft_entries", 0) or 0):
            raise UnsupportedLayoutError(
                f"a prefill with pipeline parallel size {pp_size} (--pp-size) and "
                "speculative decoding's draft KV buffers: kvstate cannot tell which layer "
                "each buffer holds; run the prefill with --pp-size 1"
            )
        if getattr(kv_args, "state_data_ptrs", None):
            raise UnsupportedLayoutError(
                f"a prefill with pipeline parallel size {pp_size} (--pp-size) and state "
                "pools (Mamba/SWA): kvstate moves state slots from pp_size 1 prefills "
                "only; run the prefill with --pp-size 1"
            )
    if getattr(
        server_args, "disaggregation_decode_allocation_policy", None
    ) == "prefill_complete" or _on("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"):
        raise UnsupportedLayoutError(
            "the prefill_complete decode allocation policy and forced prefill DP-rank "
            "queries need SGLang's bootstrap HTTP server; kvstate's backend has none: "
            "use the default allocation policy (the DP rank follows bootstrap_room)"
        )
    if _on("SGLANG_DISAGG_STAGING_BUFFER"):
        raise UnsupportedLayoutError(
            "SGLANG_DISAGG_STAGING_BUFFER=1: kvstate's backend has no staging buffers; it "
            "writes each decode rank's KV heads straight into its pages at any TP sizes: "
            "unset SGLANG_DISAGG_STAGING_BUFFER"
        )
    threshold = float(getattr(server_args, "disaggregation_decode_host_receive_threshold", 1))
    if role == "decode" and threshold < 1:
        raise UnsupportedLayoutError(
            f"--disaggregation-decode-host-receive-threshold {threshold:g}: host KV "
            "destinations are not supported by kvstate's backend (nor by SGLang's own "
            "backends in 0.5.23): leave it at 1"
        )


__all__ = ["SLOT_STATES", "refuse_unsupported"]
