"""Every KV cache layout vLLM 0.34 can hand register_kv_caches, through the same
harness: each moves byte-exact, a layout or geometry mismatch between the engines is
refused per request (the decode computes the prompt itself, the prefill frees its
blocks), and caches vLLM's allocator never makes are refused at start-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm_rig import ALL_LAYOUTS, module_redis, prompt

pytestmark = pytest.mark.vllm
CASES = [*ALL_LAYOUTS, "MLA"]


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def pairs(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill and a decode engine per layout (MLA: the backends' layout), all
    started side by side."""
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    model = write_model(tmp_path_factory.mktemp("model"))
    specs = []
    for case in CASES:
        layout, mla = (None, True) if case == "MLA" else (case, False)
        for role in ("kv_producer", "kv_consumer"):
            specs.append(Spec(role, f"{role[3]}-{case}", url, model, layout=layout, mla=mla))
    engines = start(specs)
    yield {case: (engines[2 * i], engines[2 * i + 1]) for i, case in enumerate(CASES)}
    for e in engines:
        e.close()


@pytest.mark.parametrize("case", CASES)
def test_layout_moves_byte_exact(url: str, pairs: dict[str, Any], case: str) -> None:
    from tests.integrations.vllm_engine import ask, room_keys, settle
    from tests.integrations.vllm_model import reference

    p, d = pairs[case]
    assert p.config.cache_config.kv_cache_layout == d.config.cache_config.kv_cache_layout
    prompts = {"l-9": prompt(1, 9), "l-8": prompt(2, 8), "l-23": prompt(3, 23)}
    for rid, toks in prompts.items():
        ask(p, d, rid, toks, 5)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1, rid  # loaded, not recomputed
        assert d.tokens[rid] == reference(toks, 5), rid
    assert d.mismatches == [] and d.bytes_verified[0] > 0
    assert p.problems() == [] and d.problems() == []
    assert room_keys(url) == []


def test_engines_with_different_layouts_refuse_the_pages(url: str, pairs: dict[str, Any]) -> None:
    """Same pages, another byte order: the decode must not take them."""
    from tests.integrations.vllm_engine import ask, drive, room_keys, settle
    from tests.integrations.vllm_model import reference

    p, _ = pairs["LBNHC"]
    _, d = pairs["LBHNC"]
    toks = prompt(4, 14)
    ask(p, d, "mix", toks, 5)
    assert "LBNHC" in p.params["mix"]["kvstate_kv"]
    drive([d, p], lambda: p.held() == 0, max_steps=4)
    settle(p, d)
    assert d.first_computed["mix"] == 0 and d.tokens["mix"] == reference(toks, 5)
    assert d.mismatches == [] and p.problems() == [] and d.problems() == []
    assert room_keys(url) == []


def test_caches_vllm_does_not_allocate_are_refused_at_start_up(tmp_path: Path) -> None:
    """FlashInfer's old blocks-first shape, the old [2, blocks, ...] shape, and views
    whose block count or page size is not the KVCacheConfig's."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstate.integrations.vllm import LayoutRefusedError
    from tests.integrations.vllm_rig import HEAD_SIZE, HEADS, Spec, plan, vllm_config, write_model

    spec = Spec("kv_consumer", "refuse", "redis://unused", write_model(tmp_path), blocks=40)
    config = vllm_config(spec)
    configs, _ = plan(spec, config)
    n, bs = configs[0].num_blocks, spec.block_size
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, configs[0])
    cases = {
        "blocks-first": ((n, 2, bs, HEADS, HEAD_SIZE), "a 5-D cache"),
        "K/V-first": ((2, n, bs, HEADS, HEAD_SIZE), "a 5-D cache"),
        "blocks": ((n + 3, HEADS, bs, 2 * HEAD_SIZE), f"{n + 3} blocks"),
        "page": ((n, HEADS, bs, HEAD_SIZE), "the KVCacheConfig's spec"),
    }
    for what, (shape, match) in cases.items():
        caches = {name: torch.zeros(shape, dtype=torch.float16) for name in spec.layers}
        with pytest.raises(LayoutRefusedError, match=match) as info:
            conn.register_kv_caches(caches)
        assert "kvstate supports" in str(info.value) and "LBNHC" in str(info.value), what
