"""Pipeline and data parallelism, and where the KV cache lives, through the harness:
a pipeline-parallel prefill (every stage's workers send their own layers, which meet the
decode's by name), data-parallel engines (vLLM's per-rank copies of the config, engine
ids suffixed ``_dp<rank>``, one torch.distributed world across them) whose rooms bind
to the right ranks, and what is refused at start-up: a pipeline-parallel decode, a
block-outer layout on a pipeline-parallel prefill, a ``kv_buffer_device`` that is not
where the KV cache lives (kvstate does not stage KV through host buffers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
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
def engines(url: str, model: str) -> Iterator[dict[str, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec

    specs = [
        Spec("kv_producer", "pp", url, model, tp=2, pp=2, chunk=16),
        Spec("kv_consumer", "pd", url, model, kv_buffer_device="cpu"),  # where its cache is
        # DeepSeek-style: MLA, an engine per data-parallel rank on each side
        Spec("kv_producer", "dpp", url, model, dp=2, mla=True),
        Spec("kv_consumer", "dpd", url, model, dp=2, tp=2, mla=True),
    ]
    running = start(specs)
    names = ["pp", "pd", "dpp0", "dpp1", "dpd0", "dpd1"]
    yield dict(zip(names, running, strict=True))
    for e in running:
        e.close()


def in_flight(url: str, room: int) -> list[str]:
    """The participants of a room (``tx:<engine>``, ``rx:<engine>``)."""
    from tests.integrations.vllm_engine import room_keys

    tag = "{" + str(room) + "}:"
    return sorted(k.split(tag, 1)[1] for k in room_keys(url) if tag in k and ":room" not in k)


def test_pipeline_parallel_prefill_sends_each_stage_s_layers(
    url: str, engines: dict[str, Any]
) -> None:
    """Prefill TP 2 x PP 2 (each stage one of the 2 layers), decode TP 1: the decode
    reads each layer from its stage and each head from its TP rank (4 senders)."""
    from tests.integrations.vllm_engine import ask, keys_left, settle
    from tests.integrations.vllm_model import reference

    p, d = engines["pp"], engines["pd"]
    prompts = {"pp-21": prompt(1, 21), "pp-40": prompt(2, 40), "pp-3": prompt(3, 3)}
    toks = prompts["pp-21"]
    ask(p, d, "pp-21", toks, 4)
    p.step()
    d.step()  # published to the 4 prefill workers
    room = int(p.params["pp-21"]["kvstate_room"])
    assert in_flight(url, room) == [
        *("rx:vllm@pd.tp0",),
        *(f"tx:vllm@pp.pp{s}.tp{r}" for s in (0, 1) for r in (0, 1)),
    ]
    for rid in ("pp-40", "pp-3"):
        ask(p, d, rid, prompts[rid], 4)
    before = sum(d.bytes_verified)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1, rid
        assert d.tokens[rid] == reference(toks, 4), rid
    print(f"PP 2 x TP 2 -> TP 1: {sum(d.bytes_verified) - before} KV bytes compared")
    assert d.mismatches == [] and p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_data_parallel_rooms_bind_to_their_ranks(url: str, engines: dict[str, Any]) -> None:
    """Two data-parallel prefill engines and two data-parallel decode engines (TP 2,
    MLA): a request prefilled on DP rank 1 and decoded on DP rank 0 is a room between
    exactly those engines' workers, and the other way round."""
    from tests.integrations.vllm_engine import ask, keys_left, settle
    from tests.integrations.vllm_model import reference

    assert engines["dpp1"].config.kv_transfer_config.engine_id == "dpp_dp1"  # vLLM's suffix
    routes = {"dp-a": ("dpp1", "dpd0"), "dp-b": ("dpp0", "dpd1")}
    toks = {"dp-a": prompt(4, 19), "dp-b": prompt(5, 26)}
    for rid, (pk, dk) in routes.items():
        p, d = engines[pk], engines[dk]
        ask(p, d, rid, toks[rid], 4)
        p.step()
        d.step()
        n = pk[-1]
        assert in_flight(url, int(p.params[rid]["kvstate_room"])) == [
            f"rx:vllm@dpd_dp{dk[-1]}.tp0",
            f"rx:vllm@dpd_dp{dk[-1]}.tp1",
            f"tx:vllm@dpp_dp{n}.tp0",
        ]
    for pk, dk in routes.values():
        settle(engines[pk], engines[dk])
    for rid, (pk, dk) in routes.items():
        d = engines[dk]
        assert d.first_computed[rid] == len(toks[rid]) - 1, rid
        assert d.tokens[rid] == reference(toks[rid], 4) and d.mismatches == []
        assert engines[pk].problems() == [] and d.problems() == []
        print(f"DP {rid}: {sum(d.bytes_verified)} KV bytes compared on {dk}")
    assert keys_left(url) == []


@pytest.mark.parametrize(
    ("what", "spec", "message"),
    [
        (
            "a pipeline-parallel decode",
            {"role": "kv_consumer", "pp": 2},
            "pipeline_parallel_size 2 on a decode .kv_consumer. engine",
        ),
        (
            "a block-outer layout on a pipeline-parallel prefill",
            {"role": "kv_producer", "pp": 2, "layout": "BLHNC"},
            "pipeline_parallel_size 2 with KV cache layout BLHNC",
        ),
        (
            "host staging asked of a cache that is not on the host",
            {"role": "kv_consumer", "kv_buffer_device": "cuda"},
            "kv_buffer_device='cuda', but the KV cache is on cpu: KVStateConnector moves",
        ),
    ],
)
def test_refused_at_start_up(
    url: str, model: str, what: str, spec: dict[str, Any], message: str
) -> None:
    from kvstate.integrations.vllm import VLLMConfigError
    from tests.integrations.vllm_engine import Engine
    from tests.integrations.vllm_rig import Spec, WorkerDied

    with pytest.raises((WorkerDied, VLLMConfigError), match=message):
        Engine(Spec(engine_id="refused", url=url, model_dir=model, **spec))


def test_host_staging_of_a_device_cache_is_refused(tmp_path: Path) -> None:
    """kv_buffer_device=cpu (NixlConnector: stage the KV through host buffers) for a
    KV cache on a device (``meta`` here, standing for cuda) is refused when the caches
    register, naming the option, never ignored."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstate.integrations.vllm import VLLMConfigError
    from tests.integrations.vllm_rig import Spec, plan, vllm_config, write_model

    spec = Spec("kv_consumer", "x", "redis://unused", write_model(tmp_path), kv_buffer_device="cpu")
    config = vllm_config(spec)
    configs, _ = plan(spec, config)
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, configs[0])
    caches = {n: torch.empty((48, 4, 4, 16), device="meta") for n in spec.layers}
    with pytest.raises(
        VLLMConfigError, match="kv_buffer_device='cpu', but the KV cache is on meta"
    ):
        conn.register_kv_caches(caches)
