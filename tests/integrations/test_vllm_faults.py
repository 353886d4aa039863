"""SIGKILLed engines under the harness (leases of 2 s, stretched by the time factor), in
shapes of different TP sizes: a dead decode (TP 1, fed by 2 prefill ranks)'s room fails
on both prefill ranks, which free the blocks; a dead prefill (TP 1, read by 2 decode
ranks)'s room fails on both decode ranks, and the decode recomputes the prompt (its
load reported through get_block_ids_with_load_errors)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import scaled, wait_for
from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm
FAST = {"lease": scaled(2.0), "transfer_timeout": scaled(5.0)}


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def engines(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    model = write_model(tmp_path_factory.mktemp("model"))
    # name: (role, TP size)
    names = {"p": ("kv_producer", 2), "d1": ("kv_consumer", 1)}
    names.update({"p1": ("kv_producer", 1), "d2": ("kv_consumer", 2)})
    specs = [Spec(r, f"k-{n}", url, model, tp=tp, extra=FAST) for n, (r, tp) in names.items()]
    out = dict(zip(names, start(specs), strict=True))
    yield out
    for e in out.values():
        e.close()


def failed_transfers(e: Any) -> int:
    """What the engine's workers counted in vllm:kvstate_num_failed_transfers."""
    return sum(len(s.kv_connector_stats.get("num_failed_transfers", ())) for s in e.kv_stats)


def test_sigkilled_decode_frees_the_prefill_blocks(url: str, engines: dict[str, Any]) -> None:
    import redis

    from tests.integrations.vllm_engine import drive, prefill, room_keys

    p, d1 = engines["p"], engines["d1"]
    toks = prompt(1, 15)
    params = prefill(p, "kill-d", toks)
    p.step()  # the prefill's sender exists
    d1.add("kill-d", toks, 5, params)
    d1.step()  # published: to both prefill ranks, each sending one half of the heads
    d1.kill()
    t0 = time.monotonic()
    steps = drive([p], lambda: p.held() == 0, max_steps=1000, pause=scaled(0.02))
    print(f"prefill freed {time.monotonic() - t0:.2f} s / {steps} steps after the decode died")
    assert p.problems() == []
    assert failed_transfers(p) >= 1  # vllm:kvstate_num_failed_transfers

    # what is left is the dead decode's own receiver, under its TTL (the leak backstop),
    # once the prefill's clear, behind its last step, ran
    def only_the_dead() -> bool:
        return all("k-d1" in k or k.endswith("}:room") for k in room_keys(url))

    assert wait_for(only_the_dead, 5), room_keys(url)
    left = room_keys(url)
    assert left
    with redis.Redis.from_url(url) as c:
        assert all(0 < c.ttl(k) <= 900 for k in left)
        c.delete(*left)


def test_sigkilled_prefill_fails_the_load_and_the_decode_recomputes(
    url: str, engines: dict[str, Any]
) -> None:
    from tests.integrations.vllm_engine import drive, keys_left, prefill
    from tests.integrations.vllm_model import reference

    p, d2 = engines["p1"], engines["d2"]
    toks = prompt(2, 15)
    params = prefill(p, "kill-p", toks)
    d2.add("kill-p", toks, 5, params)
    d2.step()  # both decode ranks published, each routed to the prefill's one rank
    p.kill()
    t0 = time.monotonic()
    drive([d2], lambda: not d2.scheduler.has_requests(), max_steps=1000, pause=scaled(0.02))
    print(f"decode recomputed {time.monotonic() - t0:.2f} s after the prefill died")
    assert d2.first_computed["kill-p"] == 0  # its load failed: recomputed
    assert failed_transfers(d2) == 2  # each decode rank's load
    assert d2.tokens["kill-p"] == reference(toks, 5)
    assert d2.mismatches == [] and d2.problems() == []
    assert keys_left(url) == []
