"""Hybrid models for the vLLM harness: a sliding-window + full-attention model (Qwen2
with ``layer_types``) and a Mamba2 + attention model (GraniteMoeHybrid), tiny
configs built at test time, their layers' KV cache specs as vLLM's layers report them,
and what the emulated forward (vllm_model.py) needs to find each layer's pages.

The harness runs on vLLM's UnspecifiedPlatform: this host has no GPU, and vLLM 0.34's
CPU platform refuses to configure without triton-cpu ("vLLM on x86 CPUs requires
Triton"), which PyPI does not serve. On that platform ``support_hybrid_kv_cache()`` is
False and VllmConfig turns the hybrid KV cache manager off for every connector. The
CUDA and CPU platforms support it, and there VllmConfig leaves it on exactly when
``KVConnectorFactory.supports_hma_config`` accepts the connector (checked here, on
vLLM's own factory); ``hma_on`` then sets what VllmConfig decides there. Everything
after it is vLLM's own: KV cache groups and sizes (get_kv_cache_configs), the
hybrid KV cache coordinator and its per-group managers in the Scheduler,
allocate_kv_cache's overlaid groups, the worker connector glue.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WINDOW = 8  # tokens: the sliding-window layers' window (2 blocks of 4)
SWA_LAYERS = ["sliding_attention", "full_attention"]
MAMBA_LAYERS = ["mamba", "attention"]


def write_hybrid(path: Path, kind: str, heads: int, head_size: int, layers: int) -> str:
    """config.json of a hybrid model vLLM's ModelConfig reads without a hub."""
    path.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "hidden_size": heads * head_size,
        "intermediate_size": 64,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    if kind == "swa":
        cfg |= {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "layer_types": SWA_LAYERS[:layers],
        }
    else:
        cfg |= {
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "model_type": "granitemoehybrid",
            "layer_types": MAMBA_LAYERS[:layers],
            "mamba_n_heads": 8,
            "mamba_d_head": 8,
            "mamba_expand": 2,
            "mamba_d_state": 4,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
            "num_local_experts": 0,
            "shared_intermediate_size": 64,
        }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def layer_types(model_dir: str) -> list[str]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return list(cfg.get("layer_types") or [])


def layer_name(kind: str, i: int) -> str:
    """The layer's name in vLLM's model (Qwen2's attention, GraniteMoeHybrid's mixer)."""
    return f"model.layers.{i}.mixer" if kind == "mamba" else f"model.layers.{i}.self_attn.attn"


def hma_on(config: Any) -> None:
    """What VllmConfig decides on a platform with a hybrid KV cache manager (module
    docstring): on, for a connector vLLM's factory says supports it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False


def mamba_spec(config: Any, attn_page: int) -> Any:
    """The Mamba layers' spec: the model class's own state shapes and dtypes, the
    page padded to the attention page (vLLM's hybrid alignment)."""
    from vllm.model_executor.layers.mamba.mamba_utils import mamba_state_alignment
    from vllm.v1.kv_cache_interface import MambaSpec

    mc = config.model_config
    cls, _ = mc.registry.resolve_model_cls(mc.architecture, model_config=mc)
    state = MambaSpec(
        shapes=cls.get_mamba_state_shape_from_config(config),
        dtypes=cls.get_mamba_state_dtype_from_config(config),
        state_alignment=mamba_state_alignment(config),
        block_size=int(config.cache_config.mamba_block_size or config.model_config.max_model_len),
    )
    assert state.page_size_bytes <= attn_page, (state.page_size_bytes, attn_page)
    return MambaSpec(
        shapes=state.shapes,
        dtypes=state.dtypes,
        state_alignment=state.state_alignment,
        block_size=state.block_size,
        page_size_padded=attn_page,
    )


def specs(model_dir: str, config: Any, layers: list[int], attn: Any) -> dict[str, Any]:
    """Each of ``layers``'s KV cache spec, as the model's layers report it: ``attn``
    for full attention, a SlidingWindowSpec of the same pages, a MambaSpec."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    types = layer_types(model_dir)
    out = {}
    for i in layers:
        kind = types[i]
        if kind == "sliding_attention":
            out[layer_name(kind, i)] = SlidingWindowSpec(
                block_size=attn.block_size,
                num_kv_heads=attn.num_kv_heads,
                head_size=attn.head_size,
                dtype=attn.dtype,
                sliding_window=WINDOW,
            )
        elif kind == "mamba":
            out[layer_name(kind, i)] = mamba_spec(config, attn.page_size_bytes)
        else:
            out[layer_name(kind, i)] = attn
    return out


def model_layers(model_dir: str, kv_cache_config: Any, layers: list[int]) -> list[Any]:
    """The emulated forward's view of ``layers``: each one's KV cache group and window,
    or that it is a Mamba layer."""
    from tests.integrations.vllm_model import Layer

    types = layer_types(model_dir)
    group = {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names}
    out = []
    for i in layers:
        kind = types[i]
        name = layer_name(kind, i)
        if kind != "mamba":
            window = WINDOW if kind == "sliding_attention" else 0
            out.append(Layer(i, name, group[name], window))
            continue
        out.append(Layer(i, name, group[name], 0, True))
    return out
