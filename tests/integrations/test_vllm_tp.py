"""Tensor parallelism of different sizes through the harness (worker processes on
gloo, vLLM's TP groups): every decode rank reads each KV head it holds from the one
prefill rank kvstate.tp routes it to; GQA with fewer KV heads than ranks (heads
replicated, dummies for prefill ranks nobody reads); MLA (every decode rank gets the
latent from one prefill rank, the others move nothing). Each shape moves byte-exact:
every slot a decode rank holds is read back against the pattern the prefill's ranks
wrote (the pattern carries the global head), at the step the load is reported."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm
# (prefill engine, decode engine) per shape; the model has 2 KV heads (4 query heads)
SHAPES = {
    "1->2": ("p1", "d2"),  # each decode rank one of the prefill's two heads
    "1->4": ("p1", "d4"),  # GQA: 4 decode ranks, each head on two of them
    "2->1": ("p2", "d1"),  # the decode gathers one head from each prefill rank
    "4->1": ("p4", "d1"),  # GQA: two prefill ranks hold each head, two are dummies
    "2->2": ("p2", "d2"),  # equal TP: rank i to rank i
    "MLA 1->2": ("m1", "n2"),  # both decode ranks read the latent from the one rank
    "MLA 2->1": ("m2", "n1"),  # one prefill rank sends, the other is a dummy
}


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def engines(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    gqa = write_model(tmp_path_factory.mktemp("gqa"), kv_heads=2)
    mla = write_model(tmp_path_factory.mktemp("mla"))
    specs = {
        f"{side}{tp}": Spec(role, f"tp-{side}{tp}", url, gqa, tp=tp, chunk=16)
        for side, role in (("p", "kv_producer"), ("d", "kv_consumer"))
        for tp in (1, 2, 4)
    }
    for side, role in (("m", "kv_producer"), ("n", "kv_consumer")):
        for tp in (1, 2):
            specs[f"{side}{tp}"] = Spec(role, f"tp-{side}{tp}", url, mla, tp=tp, mla=True)
    out = dict(zip(specs, start(list(specs.values())), strict=True))
    yield out
    for e in out.values():
        e.close()


def show(url: str, room: int) -> dict[str, Any]:
    cli = [sys.executable, "-m", "kvstate.cli", "--url", url, "show", str(room), "--json"]
    return json.loads(subprocess.run(cli, check=True, capture_output=True, text=True).stdout)


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_moves_byte_exact(url: str, engines: dict[str, Any], shape: str) -> None:
    from tests.integrations.vllm_engine import ask, keys_left, settle
    from tests.integrations.vllm_model import reference

    p, d = (engines[k] for k in SHAPES[shape])
    prompts = {f"{shape}-10": prompt(1, 10), f"{shape}-37": prompt(2, 37)}
    prompts[f"{shape}-3"] = prompt(3, 3)
    before = list(d.bytes_verified)
    for rid, toks in prompts.items():
        ask(p, d, rid, toks, 5)
    settle(p, d)
    for rid, toks in prompts.items():
        assert d.first_computed[rid] == len(toks) - 1, rid  # loaded, not recomputed
        assert d.tokens[rid] == reference(toks, 5), rid
    read = [a - b for a, b in zip(d.bytes_verified, before, strict=True)]
    print(f"{shape}: {sum(read)} KV bytes compared on {len(read)} decode rank(s)")
    assert d.mismatches == [] and min(read) > 0  # every rank read its own heads
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_the_room_shows_which_rank_sends_which_heads(url: str, engines: dict[str, Any]) -> None:
    """4 prefill ranks (2 KV heads: each held twice) to 1 decode rank: ranks 0 and 2
    send one head each, ranks 1 and 3 move nothing; then 1 prefill rank to 4 decode
    ranks (each head read by two). `kvstate show` while the rooms wait for the sends."""
    from tests.integrations.vllm_engine import keys_left, prefill, settle

    def moves(p: Any, d: Any, rid: str) -> dict[tuple[str, str], str]:
        toks = prompt(9, 13)
        params = prefill(p, rid, toks)
        d.add(rid, toks, 3, params)
        d.step()  # every decode rank published; the prefill's senders have not sent
        infos = show(url, int(params["kvstate_room"]))["transfer_infos"]
        out = {(tx, rx): info["moves"] for tx, per in infos.items() for rx, info in per.items()}
        settle(p, d)
        return out

    got = moves(engines["p4"], engines["d1"], "show-4->1")
    d0 = "vllm@tp-d1.tp0"
    assert got == {
        ("vllm@tp-p4.tp0", d0): "heads 0-0 -> 0-0",
        ("vllm@tp-p4.tp1", d0): "nothing (dummy)",
        ("vllm@tp-p4.tp2", d0): "heads 0-0 -> 1-1",
        ("vllm@tp-p4.tp3", d0): "nothing (dummy)",
    }
    got = moves(engines["p1"], engines["d4"], "show-1->4")
    assert got == {
        ("vllm@tp-p1.tp0", f"vllm@tp-d4.tp{r}"): f"heads {r // 2}-{r // 2} -> 0-0" for r in range(4)
    }
    assert keys_left(url) == []


def test_decode_abort_frees_every_prefill_rank(url: str, engines: dict[str, Any]) -> None:
    """4 prefill ranks (2 of them dummies) for 1 decode rank that aborts after it
    published: every prefill rank's sender fails and frees within two steps (the run behind the
    first sees the abort, the second reports it)."""
    from tests.integrations.vllm_engine import drive, keys_left, prefill, settle

    p, d = engines["p4"], engines["d1"]
    toks = prompt(4, 13)
    params = prefill(p, "tp-abort", toks)
    p.step()  # a sender on each rank
    d.add("tp-abort", toks, 5, params)
    d.step()
    d.abort("tp-abort")
    d.step()
    assert p.held() > 0
    assert drive([p], lambda: p.held() == 0, max_steps=3) <= 2  # every rank reported
    settle(p, d)
    assert p.problems() == [] and d.problems() == []
    assert keys_left(url) == []


def test_what_no_route_serves_is_refused_with_the_reason() -> None:
    """The decode's per-request check (handoff.refusal), whose refusals the harness
    shows fall back to recompute (test_vllm_layouts): TP sizes where neither divides
    the other, and parts of pages a layout cannot split; one head a rank on both
    sides moves whole pages, so LHBNC is taken then."""
    from dataclasses import replace

    from kvstate.integrations.vllm.handoff import KVFacts, refusal

    d = KVFacts("LBNHC", "FullAttentionSpec", 2, 4, 64, "float16", 4, False, tp=4, pp=1)
    assert "one must divide the other" in refusal("P", replace(d, tp=3), "D", d)
    assert refusal("P", replace(d, tp=1), "D", d) == ""
    split = "KV cache layout LHBNC keeps each KV head in a run of its own"
    lh = replace(d, layout="LHBNC", split=split)
    assert split in refusal("P", replace(lh, tp=1), "D", lh)
    one = replace(lh, kv_heads=2, tp=2)  # 1 head a rank at TP 2 and at TP 4
    assert refusal("P", one, "D", replace(one, tp=4)) == ""
    assert "KV heads 2 there, 4 here" in refusal("P", one, "D", lh)
    # NixlConnector moves blocks of other sizes (block_size_ratio); kvstate refuses
    assert "block size 16 there, 4 here" in refusal("P", replace(d, block_size=16), "D", d)
    # facts of another type than kvstate's (a list, a bool for a count) are not read
    sent = d.params()
    assert KVFacts.from_params(sent) == d
    for field, value in (("split", ["x"]), ("tp", True), ("pp", "1"), ("mla", 0)):
        theirs = KVFacts.from_params(dict(sent, **{field: value}))
        assert theirs is None, field
        assert "sent no KV cache facts kvstate can read" in refusal("P", theirs, "D", d)


def test_transfers_reach_vllms_stats_and_prometheus(
    url: str, engines: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """4 prefill ranks (2 dummies) send one request to 1 decode rank: each worker's
    KVStateConnectorStats goes through vLLM's KVOutputAggregator and scheduler into
    SchedulerStats, which vLLM's own PrometheusStatLogger and LoggingStatLogger take:
    two sends (the dummies move nothing), the bytes of the decode's blocks."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    from tests.integrations.vllm_engine import ask, keys_left, settle
    from tests.integrations.vllm_rig import HEAD_SIZE

    p, d = engines["p4"], engines["d1"]
    before = len(p.kv_stats)
    toks = prompt(7, 13)  # 4 blocks of 4 tokens
    ask(p, d, "metrics", toks, 2)
    settle(p, d)
    stats = p.kv_stats[before:]
    prom = PrometheusStatLogger(p.config, [0])
    log = LoggingStatLogger(p.config, 0)
    for s in stats:
        prom.record(s, None, engine_idx=0)
        log.record(s, None, engine_idx=0)
    labels = {"model_name": p.config.model_config.served_model_name, "engine": "0"}
    sends = REGISTRY.get_sample_value("vllm:kvstate_xfer_time_seconds_count", labels)
    nbytes = REGISTRY.get_sample_value("vllm:kvstate_bytes_transferred_sum", labels)
    block = 2 * 4 * 2 * HEAD_SIZE * 2  # the decode's block of a layer: 2 heads, 4 tokens, K+V
    assert (sends, nbytes) == (2, 4 * 2 * block)  # 4 blocks x 2 layers, half from each
    for name in ("num_failed_transfers", "num_kv_expired_reqs", "num_recompute_fallbacks"):
        assert REGISTRY.get_sample_value(f"vllm:kvstate_{name}_total", labels) == 0
    vlog = logging.getLogger("vllm.v1.metrics.loggers")  # vLLM's loggers do not propagate
    vlog.addHandler(caplog.handler)
    try:
        caplog.set_level("DEBUG", logger=vlog.name)  # an engine idle since: DEBUG
        log.log()
    finally:
        vlog.removeHandler(caplog.handler)
    line = next(r.getMessage() for r in caplog.records if "KV Transfer metrics" in r.getMessage())
    assert "Num successful transfers=2" in line and "Num failed transfers=0" in line, line
    assert keys_left(url) == []
