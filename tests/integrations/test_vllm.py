"""kvstate's vLLM connector on vLLM 0.34.0's own machinery (tests/integrations/vllm_rig.py):
real v1 Schedulers with their KV cache managers and block pools, KV caches from
allocate_kv_cache in worker processes behind vLLM's connector glue, a real Redis.
Every flow checks at the end: decode tokens equal one engine's, every KV slot read back
byte for byte, both schedulers empty, no room key left."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import scaled
from tests.integrations.vllm_rig import module_redis, prompt

pytestmark = pytest.mark.vllm


url = pytest.fixture(scope="module")(module_redis)


@pytest.fixture(scope="module")
def engines(url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    from tests.integrations.vllm_engine import start
    from tests.integrations.vllm_rig import Spec, write_model

    model = write_model(tmp_path_factory.mktemp("model"))
    specs = {
        "p": Spec("kv_producer", "pa", url, model, chunk=16),
        "d": Spec("kv_consumer", "db", url, model, chunk=16),
        # fails a request whose load failed; few blocks, so running requests get preempted
        "dq": Spec("kv_consumer", "dq", url, model, blocks=33, policy="fail"),
        # a prefill that gives up on a decode that never publishes after 2 s
        "px": Spec("kv_producer", "px", url, model, extra={"bootstrap_timeout": 2}),
    }
    running = dict(zip(specs, start(list(specs.values())), strict=True))
    yield running
    for e in running.values():
        e.close()


def check(url: str, *engines: object, expect: dict[str, list[int]] | None = None) -> None:
    from tests.integrations.vllm_engine import Engine, room_keys
    from tests.integrations.vllm_model import reference

    for e in engines:
        assert isinstance(e, Engine)
        assert e.mismatches == [], e.mismatches
        assert e.problems() == [], (e.spec.engine_id, e.problems())
    d = engines[-1]
    assert isinstance(d, Engine)
    for rid, toks in (expect or {}).items():
        assert d.tokens[rid] == reference(toks, len(d.tokens[rid])), rid
    assert room_keys(url) == []


def test_factory_loads_the_connector_by_module_path_and_by_plugin_name(tmp_path: Path) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.plugins import load_general_plugins

    from kvstate.integrations.vllm import KVStateConnector, VLLMConfigError
    from tests.integrations.vllm_rig import Spec, vllm_config, write_model

    model = write_model(tmp_path)
    cfg = vllm_config(Spec("kv_producer", "prefill-a", "redis://unused", model))
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is KVStateConnector
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    assert isinstance(conn, KVStateConnector) and conn.engine == "vllm@prefill-a"
    load_general_plugins()  # the vllm.general_plugins entry point registers the name
    by_name = KVTransferConfig(kv_connector="KVStateConnector", kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(by_name) is KVStateConnector
    for spec, match in (
        (Spec("kv_both", "x", "redis://unused", model), "kv_producer .prefill. or kv_consumer"),
        (Spec("kv_producer", "x", "", model, extra={"lease": 0}), "lease must be a number"),
        (Spec("kv_producer", "x", "", model, extra={"leese": 3}), r"unknown key\(s\) \['leese'\]"),
    ):
        with pytest.raises(VLLMConfigError, match=match):
            KVConnectorFactory.create_connector(vllm_config(spec), KVConnectorRole.WORKER, None)


def test_requests_of_every_size_move_byte_exact(url: str, engines: dict[str, object]) -> None:
    """2.5 blocks, exactly 2 blocks, under one block, and 10 blocks through 16-token
    chunks (chunked prefill on both engines), all in flight together."""
    from tests.integrations.vllm_engine import Engine, ask, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    prompts = {"r-10": prompt(1, 10), "r-8": prompt(2, 8), "r-3": prompt(3, 3)}
    prompts["r-40"] = prompt(4, 40)
    before = sum(d.bytes_verified)
    for rid, toks in prompts.items():
        ask(p, d, rid, toks, 6)
    settle(p, d)
    assert all(d.first_computed[rid] == len(toks) - 1 for rid, toks in prompts.items())
    assert sum(d.bytes_verified) > before
    check(url, p, d, expect=prompts)


def test_prefix_cache_hits_on_either_side(url: str, engines: dict[str, object]) -> None:
    """The prefill reuses a cached prefix (and sends those shared blocks); the decode
    has a prefix cached and loads only the tail; then the whole prompt."""
    from tests.integrations.vllm_engine import Engine, ask, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    base = prompt(5, 16)
    prompts = {"h-base": base, "h-longer": base + prompt(6, 9), "h-same": list(base)}
    ask(p, d, "h-base", base, 4)
    settle(p, d)
    for rid in ("h-longer", "h-same"):
        ask(p, d, rid, prompts[rid], 4)
        settle(p, d)
    # the decode had 16 tokens cached: it loaded the rest of h-longer, and h-same
    # needed no load at all (its room was concluded so the prefill freed its blocks)
    assert d.first_computed["h-longer"] == 24 and d.first_computed["h-same"] == 15
    assert p.first_computed["h-longer"] == 16  # the prefill's own prefix hit
    check(url, p, d, expect=prompts)


def test_decode_abort_after_the_prefill_sender_exists(url: str, engines: dict[str, object]) -> None:
    import redis

    from tests.integrations.vllm_engine import Engine, drive, prefill, room_keys, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    toks = prompt(7, 14)
    params = prefill(p, "a-after", toks)
    p.step()  # its worker holds the blocks as the room's sender now
    d.add("a-after", toks, 5, params)
    d.step()  # scheduled, blocks allocated, published
    d.abort("a-after")
    d.step()  # its worker fails the room before the prefill sent anything
    [tx] = [k for k in room_keys(url) if ":tx:" in k]
    with redis.Redis.from_url(url) as c:
        assert c.hget(tx, "status") == b"Failed"
    assert p.held() > 0
    assert drive([p], lambda: p.held() == 0, max_steps=3) <= 1
    settle(p, d)
    check(url, p, d)


def test_decode_abort_before_the_decode_scheduled_it(url: str, engines: dict[str, object]) -> None:
    from tests.integrations.vllm_engine import Engine, drive, prefill, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    toks = prompt(8, 11)
    d.add("a-queued", toks, 5, prefill(p, "a-queued", toks))
    d.abort("a-queued")  # still queued: never allocated
    assert drive([p], lambda: p.held() == 0, max_steps=4) <= 3
    settle(p, d)
    check(url, p, d)


def test_decode_abort_before_the_prefill_sender_exists(
    url: str, engines: dict[str, object]
) -> None:
    """The decode published, aborted and cleared its receiver before the prefill's
    worker made its sender: the sender must start Failed, not wait out its timeout."""
    from tests.integrations.vllm_engine import Engine, drive, prefill, settle

    px, d = engines["px"], engines["d"]
    assert isinstance(px, Engine) and isinstance(d, Engine)
    toks = prompt(9, 13)
    d.add("a-early", toks, 5, prefill(px, "a-early", toks))  # px's sender: next step
    d.step()
    d.abort("a-early")
    settle_decode = drive([d], lambda: not d.scheduler.has_requests())
    assert settle_decode < 10 and px.held() > 0
    try:
        assert drive([px], lambda: px.held() == 0, max_steps=4) <= 3
    finally:  # its 2 s bootstrap timeout frees the blocks in any case
        drive([px], lambda: px.held() == 0, max_steps=500, pause=scaled(0.05))
        settle(px, d)
        check(url, px, d)


def test_prefill_side_abort_frees_at_once_and_hands_nothing_over(
    url: str, engines: dict[str, object]
) -> None:
    from tests.integrations.vllm_engine import Engine, drive, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    p.add("a-prefill", prompt(10, 40), 1, {"do_remote_decode": True})
    p.step()  # the first of three 16-token chunks
    assert p.held() > 0
    p.abort("a-prefill")
    assert p.held() == 0 and "a-prefill" not in p.params
    drive([p], lambda: not p.scheduler.has_requests())
    settle(p, d)
    check(url, p, d)


def failed_load(url: str, p: object, d: object, rid: str, toks: list[int]) -> None:
    """`kvstate abort` of a room whose decode published but whose prefill has not
    sent yet: both sides fail it."""
    from tests.integrations.vllm_engine import Engine, drive, prefill

    assert isinstance(p, Engine) and isinstance(d, Engine)
    params = prefill(p, rid, toks)
    d.add(rid, toks, 5, params)
    d.step()
    cli = [sys.executable, "-m", "kvstate.cli", "--url", url, "abort"]
    subprocess.run([*cli, str(params["kvstate_room"]), "--reason", "operator"], check=True)
    assert drive([p], lambda: p.held() == 0, max_steps=4) <= 3


def test_failed_load_is_recomputed(url: str, engines: dict[str, object]) -> None:
    from tests.integrations.vllm_engine import Engine, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    toks = prompt(11, 18)
    failed_load(url, p, d, "f-recompute", toks)
    settle(p, d)
    assert d.first_computed["f-recompute"] == 0  # reported via load errors: recomputed
    check(url, p, d, expect={"f-recompute": toks})


def test_failed_load_fails_the_request_under_policy_fail(
    url: str, engines: dict[str, object]
) -> None:
    from tests.integrations.vllm_engine import Engine, settle

    p, dq = engines["p"], engines["dq"]
    assert isinstance(p, Engine) and isinstance(dq, Engine)
    failed_load(url, p, dq, "f-fail", prompt(12, 18))
    settle(p, dq)
    assert dq.finished["f-fail"] == "error" and dq.tokens["f-fail"] == []
    check(url, p, dq)


def test_decode_preemption_recomputes_and_tokens_stay_right(
    url: str, engines: dict[str, object]
) -> None:
    from tests.integrations.vllm_engine import Engine, ask, settle

    p, dq = engines["p"], engines["dq"]
    assert isinstance(p, Engine) and isinstance(dq, Engine)
    prompts = {f"pre-{i}": prompt(20 + i, 16) for i in range(4)}
    for rid, toks in prompts.items():
        ask(p, dq, rid, toks, 40)  # 4 x 14 blocks > the decode's 32
    settle(p, dq)
    assert dq.preempted > 0
    check(url, p, dq, expect=prompts)


def test_a_room_kvstate_cannot_read_fails_its_request_alone(
    url: str, engines: dict[str, object]
) -> None:
    import redis

    from tests.integrations.vllm_engine import Engine, prefill, room_keys, settle

    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    prompts = {"c-ok": prompt(30, 12), "c-bad": prompt(31, 12)}
    for rid, toks in prompts.items():
        d.add(rid, toks, 4, prefill(p, rid, toks))
    d.step()  # both published
    bad = [k for k in room_keys(url) if ":rx:" in k]
    room = str(p.params["c-bad"]["kvstate_room"])
    [key] = [k for k in bad if "{" + room + "}" in k]
    with redis.Redis.from_url(url) as c:
        c.hset(key, "status", "Sideways")  # written by hand: not a status
    settle(p, d)
    assert d.first_computed["c-ok"] == 11 and d.first_computed["c-bad"] == 0
    check(url, p, d, expect=prompts)
