"""Tensor parallelism through the harness: two ranks per engine (worker processes on
gloo, vLLM's TP group), rank i's pages to rank i; a decode with another TP size is
refused when it starts beside the prefill."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.integrations.vllm_rig import write_model

    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def pair(url: str, model: str) -> Iterator[tuple[Any, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec

    p, d = start(
        [
            Spec("kv_producer", "tp-p", url, model, tp=2, chunk=16),
            Spec("kv_consumer", "tp-d", url, model, tp=2),
        ]
    )
    yield p, d
    p.close()
    d.close()


def test_same_tp_moves_rank_i_to_rank_i(url: str, pair: tuple[Any, Any]) -> None:
    from tests.integrations.vllm_engine import ask, room_keys, settle
    from tests.integrations.vllm_model import reference

    p, d = pair
    prompts = {"tp-10": prompt(1, 10), "tp-37": prompt(2, 37), "tp-4": prompt(3, 4)}
    for rid, toks in prompts.items():
        ask(p, d, rid, toks, 5)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1 and d.tokens[rid] == reference(toks, 5)
    # each rank read its own heads (the pattern carries the global head index)
    assert d.mismatches == [] and min(d.bytes_verified) > 0
    assert p.problems() == [] and d.problems() == []
    assert room_keys(url) == []


def test_decode_abort_frees_both_prefill_ranks(url: str, pair: tuple[Any, Any]) -> None:
    from tests.integrations.vllm_engine import drive, prefill, room_keys, settle

    p, d = pair
    toks = prompt(4, 13)
    params = prefill(p, "tp-abort", toks)
    p.step()  # a sender on each rank
    d.add("tp-abort", toks, 5, params)
    d.step()
    d.abort("tp-abort")
    d.step()
    assert p.held() > 0
    assert drive([p], lambda: p.held() == 0, max_steps=3) <= 1  # both ranks reported
    settle(p, d)
    assert p.problems() == [] and d.problems() == []
    assert room_keys(url) == []


def test_a_decode_with_another_tp_size_is_refused_at_start_up(
    url: str, model: str, pair: tuple[Any, Any]
) -> None:
    from tests.integrations.vllm_engine import Engine
    from tests.integrations.vllm_rig import Spec, WorkerDied

    with pytest.raises(WorkerDied, match=r"runs tensor_parallel_size 1, but prefill engine "):
        Engine(Spec("kv_consumer", "tp-d1", url, model, tp=1))
