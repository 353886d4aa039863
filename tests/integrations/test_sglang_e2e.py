"""kvstate as SGLang's transfer backend in a real deployment: ``sglang.launch_server``
processes (a plain server, a prefill and a decode with ``--disaggregation-transfer-backend
kvstate``) behind SGLang's router, a tiny Llama built at test time, one redis-server.

Greedy outputs through the PD pair must equal the plain server's, token for token; a
prefill with other weights (the negative control) must change them. Runs unchanged on a
GPU host (SGLang's own kernels; see sglang_servers.py): ``pytest -m sglang_e2e
tests/integrations``.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.helpers import scaled, wait_for

# a test may start servers (tens of seconds each on a loaded CPU host): more than the
# suite's 300 s per test
pytestmark = [pytest.mark.sglang, pytest.mark.sglang_e2e, pytest.mark.timeout(scaled(900))]

MAX_NEW = 12


def _clean(pd) -> None:  # type: ignore[no-untyped-def]
    """No room left in Redis (only the engines' registrations) and ``kvstate audit`` clean."""
    from tests.integrations.sglang_servers import audit

    assert wait_for(lambda: pd.room_keys() == [], 30), pd.room_keys()
    assert pd.keys(), "the engines' registrations are gone"
    result = audit(pd.redis_url)
    assert result.returncode == 0 and "clean" in result.stdout, result.stdout + result.stderr


def test_greedy_outputs_equal_a_plain_servers(sglang_pd) -> None:  # type: ignore[no-untyped-def]
    from tests.integrations.sglang_model import prompt
    from tests.integrations.sglang_servers import CHUNK, PAGE, generate

    pd = sglang_pd
    # shorter than a page, several pages, longer than the chunked-prefill size
    lengths = [5, 3 * PAGE + 3, 2 * CHUNK + 9]
    assert lengths[0] < PAGE and lengths[2] > CHUNK
    for n in lengths:
        text = prompt(n)
        plain = generate(pd.plain.url, text, MAX_NEW)
        disagg = generate(pd.router.url, text, MAX_NEW)
        assert len(plain) == MAX_NEW and disagg == plain, (n, plain, disagg)

    # 12 concurrent requests through the router, each against the plain server's answer
    texts = [prompt(4 + 9 * i, offset=i) for i in range(12)]
    expected = [generate(pd.plain.url, t, MAX_NEW) for t in texts]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(lambda t: generate(pd.router.url, t, MAX_NEW), texts))
    assert got == expected
    assert len({tuple(e) for e in expected}) > 1  # the prompts lead somewhere different
    _clean(pd)


def test_a_prefill_with_other_weights_changes_the_tokens(sglang_pd) -> None:  # type: ignore[no-untyped-def]
    """The negative control: the decode continues from the KV the prefill computed, so
    a prefill model with other weights must give other tokens (SGLang's ``fake``
    backend cannot serve: prefill refuses it). Restores model A afterwards."""
    from tests.integrations.sglang_model import prompt
    from tests.integrations.sglang_servers import generate

    pd = sglang_pd
    texts = [prompt(3 * n + 5, offset=n) for n in range(4)]
    expected = [generate(pd.plain.url, t, MAX_NEW) for t in texts]
    argv = list(pd.prefill.argv)
    model_at = argv.index("--model-path") + 1
    try:
        pd.prefill.kill()
        pd.prefill.argv[model_at] = str(pd.models["b"])
        pd.prefill.start()
        got = [generate(pd.router.url, t, MAX_NEW) for t in texts]
    finally:
        pd.prefill.kill()
        pd.prefill.argv[:] = argv
        pd.prefill.start()
    assert all(len(g) == MAX_NEW for g in got)
    assert got != expected
    assert [generate(pd.router.url, t, MAX_NEW) for t in texts] == expected
    _clean(pd)


def test_the_end_to_end_benchmark_measures_a_deployment(sglang_pd) -> None:  # type: ignore[no-untyped-def]
    """tools/bench_sglang_e2e.py's measuring parts on this deployment's servers (its
    smoke test: the servers are started once, here): TTFT and tokens/s per level, and
    the phases of the rooms traced meanwhile."""
    from tools.bench_sglang_e2e import level, phases

    pd = sglang_pd
    for url in (pd.plain.url, pd.router.url):
        row = level(url, concurrency=2, requests=2, offset=7)
        assert row["requests"] == 2
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["tokens_per_s"] > 0, row
    ph = phases(pd.redis_url)  # 1% of rooms are traced here: maybe none
    assert all(isinstance(v, list) and all(ms >= 0 for ms in v) for v in ph.values()), ph
    _clean(pd)
