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
        # one request at a time and one load waiting for it: the next waits in its queue
        "dh": Spec("kv_consumer", "dh", url, model, max_seqs=1, inflight_loads=1),
        # every room traced, to see the serving requests' trace contexts land there
        "pt": Spec("kv_producer", "pt", url, model, extra={"redis_url": f"{url}?trace_rate=1"}),
        "dt": Spec("kv_consumer", "dt", url, model, extra={"redis_url": f"{url}?trace_rate=1"}),
    }
    running = dict(zip(specs, start(list(specs.values())), strict=True))
    yield running
    for e in running.values():
        e.close()


def check(url: str, *engines: object, expect: dict[str, list[int]] | None = None) -> None:
    from tests.integrations.vllm_engine import Engine, keys_left
    from tests.integrations.vllm_model import reference

    for e in engines:
        assert isinstance(e, Engine)
        assert e.mismatches == [], e.mismatches
        assert e.problems() == [], (e.spec.engine_id, e.problems())
    d = engines[-1]
    assert isinstance(d, Engine)
    for rid, toks in (expect or {}).items():
        assert d.tokens[rid] == reference(toks, len(d.tokens[rid])), rid
    assert keys_left(url) == []


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
    # seen by the run behind one step, reported by the next
    assert drive([p], lambda: p.held() == 0, max_steps=3) <= 2
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


def test_a_request_queued_on_the_decode_keeps_the_prefill_blocks(
    url: str, engines: dict[str, object]
) -> None:
    """The decode runs one request at a time and lets one more load wait for it
    (max_num_seqs 1, max_num_inflight_kv_loads 1); a third request waits in its queue,
    without a load, longer than its prefill's 2 s bootstrap_timeout. The decode holds
    that request's room (Store.hold_many, renewed every few seconds), so the prefill
    keeps the blocks and the request loads them when its turn comes, instead of
    failing and recomputing."""
    import time

    from tests.integrations.vllm_engine import Engine, ask, drive, room_keys, settle

    p, px, dh = engines["p"], engines["px"], engines["dh"]
    assert isinstance(p, Engine) and isinstance(px, Engine) and isinstance(dh, Engine)
    ask(p, dh, "hold-running", prompt(50, 8), 100)  # runs, holding the one slot
    drive([p, dh], lambda: "hold-running" in dh.first_computed)
    ask(p, dh, "hold-loaded", prompt(51, 8), 2)  # loads, then waits for the slot
    drive([p, dh], lambda: p.held() == 0)
    assert "hold-loaded" not in dh.first_computed
    toks = prompt(52, 14)
    ask(px, dh, "hold-queued", toks, 4)
    room = str(px.params["hold-queued"]["kvstate_room"])
    wait = 2.0 + scaled(1.5)  # past the prefill's bootstrap_timeout
    t0 = time.monotonic()  # steps paced so that hold-running's 100 tokens outlast it
    drive([px, dh], lambda: time.monotonic() - t0 > wait, max_steps=10_000, pause=wait / 60)
    # still queued: never published (no receiver), the prefill still holds the blocks
    assert not [k for k in room_keys(url) if "{" + room + "}:rx:" in k]
    assert "hold-queued" not in dh.first_computed and px.held() > 0
    dh.abort("hold-running")  # the queue moves
    settle(px, dh)
    settle(p, dh)
    assert dh.first_computed["hold-queued"] == len(toks) - 1  # loaded, not recomputed
    check(url, p, px, dh, expect={"hold-queued": toks, "hold-loaded": prompt(51, 8)})


def test_prefill_blocks_for_a_decode_that_never_comes_are_freed(
    url: str, engines: dict[str, object]
) -> None:
    """No decode ever takes the request: the prefill frees its blocks after its
    bootstrap_timeout (2 s here; 30 s by default, as NixlConnector's lease) and counts
    the request in vllm:kvstate_num_kv_expired_reqs."""
    import time

    from kvstate.integrations.vllm import Settings
    from tests.integrations.vllm_engine import Engine, drive, prefill

    assert Settings.from_extra({}).bootstrap_timeout == 30.0
    px = engines["px"]
    assert isinstance(px, Engine)
    stats = len(px.kv_stats)
    prefill(px, "never", prompt(52, 11))
    t0 = time.monotonic()
    drive([px], lambda: px.held() == 0, max_steps=10_000, pause=0.05)
    waited = time.monotonic() - t0
    print(f"prefill freed the blocks {waited:.2f} s after the request finished")
    assert waited >= 2.0
    expired = [s.kv_connector_stats.get("num_kv_expired_reqs", ()) for s in px.kv_stats[stats:]]
    assert sum(len(e) for e in expired) == 1
    check(url, px)


def test_a_request_id_used_again_after_an_abort_is_a_new_request(
    url: str, engines: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 vLLM keeps the client's request id
    on both engines. The first request is aborted on the decode (its room Failed: the
    failure mark stays); the same id again gets a new room (the prefill's per-request
    nonce) and loads, as a new request."""
    from tests.integrations.vllm_engine import Engine, drive, settle

    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    p, d = engines["p"], engines["d"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    toks = prompt(53, 13)
    rooms = []
    for attempt in ("aborted", "again"):
        rid = p.submit("same-id", toks, 1, {"do_remote_decode": True})
        assert rid == "same-id"  # vLLM kept the client's id
        drive([p], lambda: "same-id" in p.finished and "same-id" in p.params)
        params = p.params.pop(rid)
        rooms.append(params["kvstate_room"])
        assert d.submit("same-id", toks, 5, params) == "same-id"
        if attempt == "aborted":
            d.abort(rid)
        settle(p, d)
        p.finished.pop(rid)
    assert d.first_computed["same-id"] == len(toks) - 1  # the second one loaded
    assert rooms[0] != rooms[1]
    check(url, p, d, expect={"same-id": toks})


def test_a_traced_room_links_to_the_serving_requests_trace(
    url: str, engines: dict[str, object]
) -> None:
    """vLLM hands each request's trace headers (the HTTP request's ``traceparent``) to
    the connector: the room's trace names it per side (``kvstate trace``, and the
    monitor's OpenTelemetry spans link to it); a malformed header is ignored, never a
    failed request."""
    import json

    from click.testing import CliRunner

    from kvstate.cli import main
    from tests.integrations.vllm_engine import Engine, drive, settle

    p, d = engines["pt"], engines["dt"]
    assert isinstance(p, Engine) and isinstance(d, Engine)
    span = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    toks = prompt(54, 12)
    rooms = {}
    for name, headers in (("linked", {"traceparent": span}), ("garbled", {"traceparent": "x"})):
        rid = p.submit(name, toks, 1, {"do_remote_decode": True}, trace_headers=headers)
        drive([p], lambda rid=rid: rid in p.finished and rid in p.params)  # type: ignore[misc]
        params = p.params.pop(rid)
        rooms[name] = params["kvstate_room"]
        d.submit(name, toks, 4, params, trace_headers=headers)
        settle(p, d)
    for name, want in (("linked", [span, span]), ("garbled", [])):
        out = CliRunner().invoke(main, ["--url", url, "trace", str(rooms[name]), "--json"])
        assert out.exit_code == 0, out.output
        doc = json.loads(out.stdout)
        assert sorted(c["side"] for c in doc["request_traces"]) == (["rx", "tx"] if want else [])
        assert [c["traceparent"] for c in doc["request_traces"]] == want
        assert any(s["event"] == "Success" for s in doc["steps"]), doc["steps"]
    check(url, p, d)
