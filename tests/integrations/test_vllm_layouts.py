"""Every KV cache layout vLLM 0.34 can hand register_kv_caches, through the same
harness: each moves byte-exact, from a TP-1 prefill to a TP-2 decode (parts of pages:
the runs' Geometry) where the layout splits by heads, a layout or geometry mismatch
between the engines is
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
    """A prefill (TP 1) and a decode engine per layout (MLA: the backends' layout), all
    started side by side. The decodes run TP 2 (each rank 2 of the 4 KV heads: parts
    of the prefill's pages), but LHBNC's (TP 1: a page there is one head, whole)."""
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    model = write_model(tmp_path_factory.mktemp("model"))
    specs = []
    for case in CASES:
        layout, mla = (None, True) if case == "MLA" else (case, False)
        for role in ("kv_producer", "kv_consumer"):
            tp = 2 if role == "kv_consumer" and case != "LHBNC" else 1
            name = f"{role[3]}-{case}"
            specs.append(Spec(role, name, url, model, tp=tp, layout=layout, mla=mla))
    engines = start(specs)
    yield {case: (engines[2 * i], engines[2 * i + 1]) for i, case in enumerate(CASES)}
    for e in engines:
        e.close()


@pytest.mark.parametrize("case", CASES)
def test_layout_moves_byte_exact(url: str, pairs: dict[str, Any], case: str) -> None:
    from tests.integrations.vllm_engine import ask, keys_left, settle
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
    assert d.mismatches == [] and min(d.bytes_verified) > 0  # every rank, its heads
    print(f"{case} TP 1 -> {d.spec.tp}: {sum(d.bytes_verified)} KV bytes compared")
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_engines_with_different_layouts_refuse_the_pages(
    url: str, pairs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Same pages, another byte order: the decode must not take them. It computes the
    prompts itself, says why in one WARNING for the pair of engines, and counts each
    request in vLLM's stats (vllm:kvstate_num_recompute_fallbacks)."""
    from tests.integrations.vllm_engine import ask, drive, keys_left, settle
    from tests.integrations.vllm_model import reference

    p, _ = pairs["LBNHC"]
    _, d = pairs["LBHNC"]
    prompts = {"mix": prompt(4, 14), "mix-2": prompt(5, 9)}
    caplog.set_level("WARNING", logger="kvstate.integrations.vllm.scheduler")
    for rid, toks in prompts.items():
        ask(p, d, rid, toks, 5)
        assert p.params[rid]["kvstate_kv"]["layout"] == "LBNHC"
        drive([d, p], lambda: p.held() == 0, max_steps=4)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == 0 and d.tokens[rid] == reference(toks, 5)
    assert d.mismatches == [] and p.problems() == [] and d.problems() == []
    assert keys_left(url) == []
    [warning] = [r for r in caplog.records if "computes requests from prefill" in r.message]
    assert warning.levelname == "WARNING"
    assert "KV cache layout 'LBNHC' there, 'LBHNC' here" in warning.message, warning.message
    fallbacks = sum(
        len(s.kv_connector_stats.get("num_recompute_fallbacks", ())) for s in d.kv_stats
    )
    assert fallbacks == 2


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


# what each layout's runs are (count, geometry heads, outer) for 4 KV heads a rank, 2
# layers, 4 tokens a block: heads outermost (outer 1), innermost (outer = tokens, times
# the layers a block-outer run holds), or one head a run (LHBNC: not split, heads 0)
GEOMETRY = {
    "LBHNC": (2, 4, 1),
    "LBNHC": (2, 4, 4),
    "LHBNC": (8, 0, 1),
    "BLHNC": (1, 4, 2),
    "BLNHC": (1, 4, 8),
    "BHLNC": (1, 4, 1),
    "MLA": (2, 0, 1),
}


def allocated(spec: Any) -> tuple[dict[str, Any], Any, str]:
    """vLLM's own planning and allocate_kv_cache for rank 0 of ``spec``, in process."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from tests.integrations.vllm_rig import plan, vllm_config

    configs, _ = plan(spec, vllm_config(spec))
    layout = configs[0].kv_cache_layout
    caches = allocate_kv_cache(configs[0], torch.device("cpu"), KVCacheLayout[layout])
    return caches, configs[0], layout


@pytest.mark.parametrize("case", CASES)
def test_each_layout_registers_its_heads_per_page(tmp_path: Path, case: str) -> None:
    """The Geometry layout.py gives each run of vLLM's own allocation: what lets TP
    sizes differ (a page as outer blocks of equal head chunks), byte-checked there."""
    from kvstate.integrations.vllm.layout import buffers
    from tests.integrations.vllm_rig import Spec, write_model

    layout, mla = (None, True) if case == "MLA" else (case, False)
    spec = Spec("kv_consumer", "g", "redis://unused", write_model(tmp_path), layout=layout, mla=mla)
    caches, config, name = allocated(spec)
    runs = buffers(caches, config, name)
    count, heads, outer = GEOMETRY[case]
    assert len(runs) == count
    assert {(b.geometry.heads, b.geometry.outer) for b in runs} == {(heads, outer)}
    assert len({b.geometry.name for b in runs}) == count  # named, each its own
    if case in ("LBHNC", "LBNHC", "MLA"):
        assert [b.geometry.name for b in runs] == spec.layers  # a pipeline stage's key
    # one head a rank (GQA: 2 KV heads over TP 4): the same outer, so parts still fit
    # (LHBNC's page is its one head then: not split off, one chunk)
    spec = Spec(
        "kv_consumer",
        "g",
        "redis://unused",
        write_model(tmp_path / "gqa", kv_heads=2),
        tp=4,
        layout=layout,
        mla=mla,
    )
    caches, config, name = allocated(spec)
    one = buffers(caches, config, name)
    want = {"MLA": (0, 1), "LHBNC": (1, 1)}.get(case, (1, outer))
    assert {(b.geometry.heads, b.geometry.outer) for b in one} == {want}


def test_pages_whose_heads_do_not_split_evenly_are_refused(tmp_path: Path) -> None:
    """A cache whose heads lie apart in a page (gaps between them) cannot move parts of
    pages between TP sizes: refused when it registers, naming the layout."""
    import torch

    from kvstate.integrations.vllm.layout import LayoutRefusedError, buffers
    from tests.integrations.vllm_rig import HEAD_SIZE, HEADS, Spec, write_model

    spec = Spec("kv_consumer", "g", "redis://unused", write_model(tmp_path), layout="LBHNC")
    caches, config, name = allocated(spec)
    n, bs = config.num_blocks, spec.block_size
    gap = bs * 2 * HEAD_SIZE + 8  # elements from head to head: 8 more than a head's
    storage = torch.zeros(n * HEADS * gap, dtype=torch.float16)
    strides = (HEADS * gap, gap, 2 * HEAD_SIZE, 1)
    odd = {k: storage.as_strided((n, HEADS, bs, 2 * HEAD_SIZE), strides) for k in spec.layers[:1]}
    with pytest.raises(LayoutRefusedError, match="do not split into equal chunks of whole KV"):
        buffers(odd, config, name)
    assert buffers({k: caches[k] for k in spec.layers[:1]}, config, name)  # vLLM's own: fine
