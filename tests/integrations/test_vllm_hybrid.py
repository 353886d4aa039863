"""Hybrid models through the harness with vLLM's hybrid KV cache manager on (the
connector is ``SupportsHMA``; vllm_hybrid.py says what runs): a sliding-window + full
attention model (two KV cache groups overlaid on one pool) moves each group's blocks a
decode needs, the window's only for the sliding-window group; a Mamba2 + attention
model (GraniteMoeHybrid) moves its attention KV and its Mamba state (conv and SSM
state in one padded page), its prefill stopping one token short as NixlConnector's
does. Every slot a decode reads (a window's for sliding-window layers) and every state
byte is compared at the step the load is reported, schedulers drained, no key left."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm

url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def engines(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    swa = write_model(tmp_path_factory.mktemp("swa"), hybrid="swa")
    mamba = write_model(tmp_path_factory.mktemp("mamba"), hybrid="mamba")
    specs = {
        "p": Spec("kv_producer", "swa-p", url, swa, hybrid=True, chunk=16),
        "d": Spec("kv_consumer", "swa-d", url, swa, hybrid=True, chunk=16),
        "d2": Spec("kv_consumer", "swa-d2", url, swa, hybrid=True, chunk=16, tp=2),
        # block size 8: the attention page (1024 B) holds the Mamba state (944 B),
        # as vLLM's hybrid alignment makes it; no prefix caching (mamba_cache_mode none)
        "mp": Spec("kv_producer", "mamba-p", url, mamba, hybrid=True, chunk=16, block_size=8),
        "md": Spec("kv_consumer", "mamba-d", url, mamba, hybrid=True, chunk=16, block_size=8),
    }
    specs["mp"].prefix_caching = specs["md"].prefix_caching = False
    out = dict(zip(specs, start(list(specs.values())), strict=True))
    yield out
    for e in out.values():
        e.close()


def groups(e: Any) -> list[str]:
    return [type(g.kv_cache_spec).__name__ for g in e.scheduler.kv_cache_config.kv_cache_groups]


def sent_bytes(e: Any, since: int) -> int:
    return sum(sum(s.kv_connector_stats.get("bytes_transferred", ())) for s in e.kv_stats[since:])


def page_bytes(e: Any) -> int:
    return int(e.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes)


def test_sliding_window_moves_each_groups_blocks(url: str, engines: dict[str, Any]) -> None:
    """Prompts from under a block to past the window with chunked prefill (the prefill
    freed the blocks out of its window), then one the decode has partly cached: the
    full-attention group moves every uncached block, the sliding-window group only
    the window's (cdiv(8, 4) + 1 blocks at most), the bytes are just those pages."""
    from tests.integrations.vllm_engine import keys_left, prefill, settle
    from tests.integrations.vllm_model import reference

    p, d = engines["p"], engines["d"]
    assert sorted(groups(p)) == sorted(groups(d)) == ["FullAttentionSpec", "SlidingWindowSpec"]
    window = groups(p).index("SlidingWindowSpec")
    prompts = {"swa-3": prompt(1, 3), "swa-10": prompt(2, 10), "swa-37": prompt(3, 37)}
    before, stats = list(d.bytes_verified), len(p.kv_stats)
    counts = {}
    for rid, toks in prompts.items():
        params = prefill(p, rid, toks)
        counts[rid] = params["kvstate_blocks"]
        d.add(rid, toks, 5, params)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1, rid  # loaded, not recomputed
        assert d.tokens[rid] == reference(toks, 5), rid
    full = {rid: -(-len(t) // 4) for rid, t in prompts.items()}
    assert {rid: c[window] for rid, c in counts.items()} == {r: min(n, 3) for r, n in full.items()}
    assert {rid: c[1 - window] for rid, c in counts.items()} == full
    moved = sum(sum(c) for c in counts.values())
    assert sent_bytes(p, stats) == moved * page_bytes(p)  # one run: the groups overlay
    hit, stats = prompt(3, 37)[:24] + prompt(4, 20), len(p.kv_stats)  # 6 blocks cached here
    d.add("swa-hit", hit, 4, prefill(p, "swa-hit", hit))
    settle(p, d)
    assert d.first_computed["swa-hit"] == len(hit) - 1
    assert d.tokens["swa-hit"] == reference(hit, 4)
    pages = sent_bytes(p, stats) // page_bytes(p)
    uncached = [m for m in range(1, 11) if min(3, m) + m == pages]  # the tail and its window
    print(f"a decode with {11 - uncached[0]} of 11 blocks cached loaded {pages} pages")
    read = sum(a - b for a, b in zip(d.bytes_verified, before, strict=True))
    print(f"sliding window + full: {read} KV bytes compared, {sent_bytes(p, stats)} moved")
    assert d.mismatches == [] and read > 0
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_sliding_window_across_tp_sizes(url: str, engines: dict[str, Any]) -> None:
    """Prefill TP 1 -> decode TP 2 on the sliding-window model: each decode rank reads
    its two KV heads of every group's blocks out of the prefill's pages."""
    from tests.integrations.vllm_engine import keys_left, prefill, settle
    from tests.integrations.vllm_model import reference

    p, d = engines["p"], engines["d2"]
    toks = prompt(10, 37)
    before = list(d.bytes_verified)
    d.add("swa-tp", toks, 5, prefill(p, "swa-tp", toks))
    settle(p, d)
    assert d.first_computed["swa-tp"] == len(toks) - 1
    assert d.tokens["swa-tp"] == reference(toks, 5)
    read = [a - b for a, b in zip(d.bytes_verified, before, strict=True)]
    print(f"sliding window + full, TP 1 -> 2: {sum(read)} KV bytes compared on 2 ranks")
    assert d.mismatches == [] and min(read) > 0
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_mamba_hybrid_moves_its_state(url: str, engines: dict[str, Any]) -> None:
    """The prefill computes the prompt but its last token (its state is the one before
    that token); the decode loads the attention KV and the Mamba state, computes the
    last prompt token on that state and goes on: tokens as one engine's, the state's
    bytes and every KV slot read back."""
    from tests.integrations.vllm_engine import keys_left, prefill, settle
    from tests.integrations.vllm_model import reference

    p, d = engines["mp"], engines["md"]
    assert sorted(groups(p)) == sorted(groups(d)) == ["FullAttentionSpec", "MambaSpec"]
    state = groups(p).index("MambaSpec")
    prompts = {"mamba-5": prompt(5, 5), "mamba-41": prompt(6, 41)}
    before, stats = list(d.bytes_verified), len(p.kv_stats)
    counts = {}
    for rid, toks in prompts.items():
        params = prefill(p, rid, toks)
        counts[rid] = params["kvstate_blocks"]
        d.add(rid, toks, 5, params)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1, rid  # state and KV loaded
        assert d.tokens[rid] == reference(toks, 5), rid
    assert {rid: c[state] for rid, c in counts.items()} == {"mamba-5": 1, "mamba-41": 1}
    kv = {rid: c[1 - state] for rid, c in counts.items()}
    assert kv == {"mamba-5": 1, "mamba-41": 5}  # KV of 4 and 40 tokens (the last one not)
    assert sent_bytes(p, stats) == (2 + 1 + 5) * page_bytes(p)
    read = sum(a - b for a, b in zip(d.bytes_verified, before, strict=True))
    print(f"Mamba2 + attention: {read} KV and state bytes compared")
    assert d.mismatches == [] and read > 0
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_hybrid_abort_and_failed_load(url: str, engines: dict[str, Any]) -> None:
    """Mamba hybrid: a decode that aborts a request whose load started fails the room,
    the prefill frees its blocks (every group's) within two steps (the run behind the
    first sees the abort, the second reports it). Sliding window:
    `kvstate abort` of a room the decode published fails its load, which vLLM
    recomputes (kv_load_failure_policy recompute): tokens right, nothing left."""
    import redis

    from tests.integrations.vllm_engine import drive, keys_left, prefill, room_keys, settle
    from tests.integrations.vllm_model import reference

    p, d = engines["mp"], engines["md"]
    toks = prompt(8, 30)
    params = prefill(p, "mamba-abort", toks)
    p.step()  # its worker holds the blocks as the room's sender
    d.add("mamba-abort", toks, 5, params)
    d.step()  # scheduled, blocks allocated in both groups, published
    d.abort("mamba-abort")
    d.step()  # its workers fail the room before the prefill sent anything
    [tx] = [k for k in room_keys(url) if ":tx:" in k]
    with redis.Redis.from_url(url) as c:
        assert c.hget(tx, "status") == b"Failed"
    assert p.held() > 0
    assert drive([p], lambda: p.held() == 0, max_steps=3) <= 2
    settle(p, d)

    p, d = engines["p"], engines["d"]
    toks = prompt(9, 26)
    params = prefill(p, "swa-failed", toks)
    d.add("swa-failed", toks, 5, params)
    d.step()
    cli = [sys.executable, "-m", "kvstate.cli", "--url", url, "abort"]
    subprocess.run([*cli, str(params["kvstate_room"]), "--reason", "operator"], check=True)
    assert drive([p], lambda: p.held() == 0, max_steps=4) <= 3
    settle(p, d)
    assert d.first_computed["swa-failed"] == 0  # reported via load errors: recomputed
    assert d.tokens["swa-failed"] == reference(toks, 5)

    # block counts that do not line up with the decode's groups (10 blocks of full
    # attention to load, 1 offered): the load is refused with the reason, recomputed
    toks = prompt(11, 26)
    params = prefill(p, "swa-refused", toks)
    d.add("swa-refused", toks, 5, {**params, "kvstate_blocks": [1, 1]})
    assert drive([p, d], lambda: p.held() == 0, max_steps=4) <= 3
    settle(p, d)
    assert d.first_computed["swa-refused"] == 0
    assert d.tokens["swa-refused"] == reference(toks, 5)
    for e in (*engines.values(),):
        assert e.mismatches == [] and e.problems() == [], e.spec.engine_id
    assert keys_left(url) == []


def planned(tmp_path: Any, kinds: dict[str, Any], model: str = "swa") -> tuple[Any, Any]:
    """vLLM's KV cache planning (groups, sizes) for layers of these specs, hybrid
    manager on, and the VllmConfig of a decode engine."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    from tests.integrations.vllm_rig import ALL_LAYOUTS, Spec, vllm_config, write_model

    spec = Spec("kv_consumer", "r", "redis://unused", write_model(tmp_path, hybrid=model))
    spec.hybrid = True
    config = vllm_config(spec)
    register_all_kvcache_specs(config)
    layout = resolve_kv_cache_layout(config, [ALL_LAYOUTS], list(kinds.values()))
    groups = get_global_kv_cache_groups(config, [kinds])
    [kv_cache_config] = get_kv_cache_configs(config, [kinds], [1 << 30], groups)
    kv_cache_config.kv_cache_layout = layout.name
    return config, kv_cache_config


def test_groups_kvstate_cannot_move_are_refused(tmp_path: Any) -> None:
    """A KV cache group kvstate does not move (chunked local attention; a Mamba state
    with prefix-caching checkpoints) refuses the engine when vLLM makes the connector
    with its KVCacheConfig, naming the group and what kvstate moves; a Mamba hybrid
    between engines of different TP sizes is refused per request (computed locally)."""
    import copy
    import dataclasses

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvstate.errors import LayoutRefusedError
    from kvstate.integrations.vllm import KVStateConnector
    from kvstate.integrations.vllm.handoff import KVFacts, refusal
    from kvstate.integrations.vllm.layout import buffers
    from tests.integrations.vllm_hybrid import mamba_spec

    full = FullAttentionSpec(block_size=8, num_kv_heads=4, head_size=8, dtype=torch.float16)
    local = ChunkedLocalAttentionSpec(
        block_size=8, num_kv_heads=4, head_size=8, dtype=torch.float16, attention_chunk_size=16
    )
    config, kv = planned(tmp_path / "local", {"a": local, "b": full})
    with pytest.raises(LayoutRefusedError, match=r"KV cache group \d \(ChunkedLocalAttentionSpec"):
        KVStateConnector(config, KVConnectorRole.SCHEDULER, kv)
    config, _ = planned(tmp_path / "mamba", {"b": full}, "mamba")
    state = mamba_spec(config, full.page_size_bytes)
    align = dataclasses.replace(state, mamba_cache_mode="align")
    config, kv = planned(tmp_path / "align", {"a": align, "b": full}, "mamba")
    with pytest.raises(LayoutRefusedError, match="mamba_cache_mode 'align'"):
        KVStateConnector(config, KVConnectorRole.SCHEDULER, kv)

    config, kv = planned(tmp_path / "state", {"a": state, "b": full}, "mamba")
    # vLLM overlays the groups' pages; state pages anywhere else are refused, not moved
    # apart from the attention run (a hand-made placement: half a page further on)
    moved = copy.deepcopy(kv)
    for t in moved.kv_cache_tensors:
        t.size += t.block_stride
        t.offset += t.block_stride // 2 if t.layers == ["a"] else 0
    caches = allocate_kv_cache(moved, torch.device("cpu"), KVCacheLayout[moved.kv_cache_layout])
    with pytest.raises(LayoutRefusedError, match="layer a: its state pages lie where no"):
        buffers(caches, moved, moved.kv_cache_layout)
    mine = KVFacts.of(config, kv)
    assert mine.stateful
    why = refusal("p", dataclasses.replace(mine, tp=2), "d", mine)
    assert "same tensor_parallel_size" in why


def test_group_blocks_and_their_split() -> None:
    """What each group keeps of a request's blocks, and the split of a decode's page
    list that the prefill reads back, for every number of new blocks."""
    from kvstate.errors import LayoutRefusedError
    from kvstate.integrations.vllm.groups import Group, flatten, split, wanted

    window = Group("window", 3, 0, "SlidingWindowSpec(window 8)")
    state = Group("state", 1, 2, "MambaSpec")
    full = Group("full", 0, 0, "FullAttentionSpec")
    assert window.clip([0, 0, 0, 7, 8]) == [7, 8]  # vLLM's null blocks: freed, not moved
    assert window.clip([4, 5, 6, 7, 8]) == [6, 7, 8]
    assert state.clip([9, 10, 11]) == [9]  # the running state, not the scratch slots
    assert full.clip([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(LayoutRefusedError, match="null block inside"):
        full.clip([1, 0, 3])
    counts = [2, 1, 10]  # window, state, full, as a prefill kept them
    for m in range(11):
        take = wanted(counts, m)
        assert split(counts, sum(take)) == take
    assert split(counts, 100) is None
    assert flatten([[1, 2], [3], [4, 5, 6]], [1, 1, 2]) == [2, 3, 5, 6]
