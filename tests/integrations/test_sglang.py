"""kvstate as SGLang's transfer backend, driven by SGLang's own code (0.5.23 from PyPI):
the plugin loader, ServerArgs, get_kv_class, poll_and_all_reduce over gloo, MetadataBuffers
and DecodeTransferQueue, with real redis-server processes and real rank processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvstate.store import connect
from tests.helpers import keys_of, scaled, wait_for

pytestmark = pytest.mark.sglang

SPAWN_TIMEOUT = 240


def _spawn(fn, args, nprocs=1):  # type: ignore[no-untyped-def]
    import torch.multiprocessing as mp

    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")


def _join(ctx, timeout: float = SPAWN_TIMEOUT) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("rank processes did not finish")


def _process(target, *args):  # type: ignore[no-untyped-def]
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def test_plugin_entry_point_server_args_and_rebound_get_kv_class() -> None:
    # the modules that imported get_kv_class before the plugin loaded get rebound copies
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins import load_plugins, load_plugins_by_group

    from kvstate.integrations import sglang as backend

    assert "kvstate" in load_plugins_by_group("sglang.srt.plugins")
    load_plugins()
    kv = TransferBackend("kvstate")
    expected = {
        KVClassType.MANAGER: backend.KVStateKVManager,
        KVClassType.SENDER: backend.KVStateKVSender,
        KVClassType.RECEIVER: backend.KVStateKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: backend.KVStateBootstrapServer,
        KVClassType.KVARGS: KVArgs,
    }
    for module in (prefill, decode, disagg_service):
        for kind, cls in expected.items():
            assert module.get_kv_class(kv, kind) is cls, (module.__name__, kind)
        # other backends are untouched
        assert (
            module.get_kv_class(TransferBackend.FAKE, KVClassType.SENDER).__name__ == "FakeKVSender"
        )
    # the name goes through SGLang's own command-line parser (ServerArgs alone accepts
    # any string: only argparse's choices check it)
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "dummy", "--disaggregation-mode", "prefill"]
    parsed = prepare_server_args([*argv, "--disaggregation-transfer-backend", "kvstate"])
    assert parsed.disaggregation_transfer_backend == "kvstate"
    with pytest.raises(SystemExit):
        prepare_server_args([*argv, "--disaggregation-transfer-backend", "nonsense"])


def test_unsupported_version_is_refused_with_what_to_do() -> None:
    from kvstate.integrations.sglang_plugin import UnsupportedSGLangError, check_version

    assert check_version() == "0.5.23"
    with pytest.raises(UnsupportedSGLangError, match="supports sglang 0.5.23; found 0.5.20"):
        check_version("0.5.20")


def test_two_rank_lifecycle_moves_kv_aux_and_state(redis_url: str, tmp_path: Path) -> None:
    from tests.integrations.rig import lifecycle

    nrooms = 4
    _join(_spawn(lifecycle, (redis_url, str(tmp_path / "gloo"), str(tmp_path), nrooms), 2))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["mismatch"] == []
        assert res["bytes"] == nrooms * 5 * 4 * 64  # KV pages of 4 buffers (aux/state aside)
        # the decode side saw SGLang's meanings in order: WaitingForInput (handshake),
        # Transferring (metadata sent), Success
        for seen in res["seen_rx"]:
            assert seen[-1] == 4 and 2 in seen
        # one poll_many per step per manager, not one per room
        assert res["tx_batches"] <= res["steps"] and res["rx_batches"] <= res["steps"]
    store = connect(redis_url)
    assert keys_of(store) == []


@pytest.mark.parametrize(
    "scenario,side,reason",
    [
        ("prefill", "tx", "aborted by prefill"),
        ("decode", "rx", "aborted by decode"),
        ("cli", "rx", "operator says no"),
    ],
)
def test_aborts_reach_the_other_side(
    redis_url: str, tmp_path: Path, scenario: str, side: str, reason: str
) -> None:
    from tests.integrations.rig import pair

    _join(_spawn(pair, (redis_url, str(tmp_path), scenario)))
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["tx"] == 0 and res["rx"] == 0  # Failed on both sides
    for name in ("tx_error", "rx_error"):
        assert res[name].startswith("KVTransferError") and reason in res[name], res
    assert keys_of(connect(redis_url)) == []


def _wait_file(path: Path, proc, timeout: float = SPAWN_TIMEOUT) -> None:  # type: ignore[no-untyped-def]
    assert wait_for(lambda: path.exists() or not proc.is_alive(), timeout), f"{path} never came"
    assert path.exists(), f"process exited with {proc.exitcode} before {path.name}"


def test_sigkilled_prefill_fails_decode_rooms_through_sglangs_queue(
    redis_url: str, tmp_path: Path
) -> None:
    from tests.integrations.rig import lone

    prefill = _process(lone, redis_url, str(tmp_path), "prefill", True)
    try:
        _wait_file(tmp_path / "prefill.started", prefill)  # registered: decode finds it
        decode = _process(lone, redis_url, str(tmp_path), "decode", False)
        _wait_file(tmp_path / "decode.ready", decode)
        _wait_file(tmp_path / "prefill.ready", prefill)
        os.kill(prefill.pid, signal.SIGKILL)
        decode.join(SPAWN_TIMEOUT)
        res = json.loads((tmp_path / "decode.json").read_text())
    finally:
        prefill.kill()
    assert res["left_queue"] and res["transferred"] == 0 and res["receiver_cleared"]
    assert "lost its lease" in res["abort"] and "KVTransferError" in res["abort"]
    assert res["released"] == ["req-9100"] and res["freed_slots"] == [7 - 0]
    assert res["streamed"] == ["req-9100"]


def test_sigkilled_decode_fails_the_prefill_room_through_sglangs_queue(
    redis_url: str, tmp_path: Path
) -> None:
    from tests.integrations.rig import lone

    prefill = _process(lone, redis_url, str(tmp_path), "prefill", False)
    decode = None
    try:
        decode = _process(lone, redis_url, str(tmp_path), "decode", True)
        _wait_file(tmp_path / "decode.ready", decode)
        _wait_file(tmp_path / "prefill.ready", prefill)
        os.kill(decode.pid, signal.SIGKILL)
        decode.join(scaled(10))
        (tmp_path / "go").write_text("1")
        prefill.join(SPAWN_TIMEOUT)
        res = json.loads((tmp_path / "prefill.json").read_text())
    finally:
        prefill.kill()
        if decode is not None:
            decode.kill()
    # SGLang's own prefill inflight queue concludes the request as it does for Mooncake
    assert res["left_queue"] and res["done"] == 1 and res["streamed"] == ["req-9100"]
    assert "KVTransferError" in res["abort"] and "transfer failed" in res["abort"]
    assert res["released"] == ["req-9100", "req-9100"] and res["freed_slots"] == [0]


def test_user_reports_fixed_by_design(redis_url: str, tmp_path: Path) -> None:
    """sglang#40125 (duplicate bootstrap_room), #39428 (injected rooms), a room id used
    again after an abort, the sender used from two threads, and mirror mode under
    another backend."""
    from tests.integrations.rig import scenarios

    _join(_spawn(scenarios, (redis_url, str(tmp_path))))
    res = json.loads((tmp_path / "scenarios.json").read_text())
    crashed = {k: v["crash"] for k, v in res.items() if isinstance(v, dict) and "crash" in v}
    assert not crashed, crashed

    # a decode of another TP size whose pool gives no KV heads per rank cannot take
    # the prefill's pages: both rooms fail with the reason, one WARNING for the pair,
    # both counted (issue 29 item 5)
    tp = res["tp_mismatch"]
    assert tp["rx"] == [0, 0] and "runs attention TP 1, this decode 2" in tp["error"]
    assert "KVArgs.kv_head_num" in tp["error"]
    assert len(tp["warnings"]) == 1 and "cannot load KV from prefill" in tp["warnings"][0]
    assert tp["refusals"] == 2 and tp["metric"] == 2

    dup = res["duplicate_local"]
    assert dup["twin"] == 0 and "duplicate bootstrap_room 11000" in dup["twin_error"]
    assert dup["first"] == [4, 4]  # the first request was not disturbed

    dup = res["duplicate_decodes"]
    assert dup["tx"] == 0 and dup["rx"] == [0, 0]
    assert "2 decode receivers" in dup["tx_error"]
    assert all("duplicate bootstrap_room 11001" in e for e in dup["rx_error"])

    # a room id used again after an abort (issue 29 item 6): the first request Failed on
    # both sides, the second a new request, byte-exact, no mark left
    reused = res["reused_after_abort"]
    assert reused["first"] == [0, 0] and reused["second"] == [4, 4], reused
    assert reused["pages_equal"] and reused["state_equal"] and reused["keys_left"] == []

    cap = res["cap_and_ttl"]
    assert cap["polls"][:40] == [1] * 40 and cap["polls"][40] == 0
    assert "cap (KVSTATE_SGLANG_MAX_ROOMS)" in cap["refused"]
    assert cap["no_ttl"] == [] and cap["after_clear"] == 0

    th = res["threads"]
    assert th["errors"] == [] and th["rx"] == [4, 4, 4, 4] and th["bytes_equal"]

    mirror = res["mirror"]
    assert mirror["classes"]["sender"] == "KVStateMirrorFakeKVSender"
    ok, aborted = mirror["rooms"]
    # decode: WaitingForInput; prefill: WaitingForInput; then Success on both,
    # recorded in kvstate (the room's keys exist until clear)
    assert ok["seen"] == [2, 2, 4, 4] and ok["tx_error"].startswith("Exception: Fake")
    assert any(k.endswith("tx:127.0.0.1:18998/dp0/tp0") for k in ok["keys"])
    # an abort only kvstate knew about fails both sides with its reason
    assert aborted["seen"][2:] == [0, 0]
    assert "mirror abort" in aborted["tx_error"] and "mirror abort" in aborted["rx_error"]
    assert keys_of(connect(redis_url)) == []


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("pp_size", 2, "a decode with pipeline parallel size 2 \\(--pp-size\\)"),
        ("disaggregation_decode_allocation_policy", "prefill_complete", "bootstrap HTTP server"),
        # host destinations (issue 29 item 3): refused, never run without
        (
            "disaggregation_decode_host_receive_threshold",
            0.5,
            "--disaggregation-decode-host-receive-threshold 0.5: host KV destinations",
        ),
    ],
)
def test_unsupported_layouts_are_refused_at_start(field: str, value: object, message: str) -> None:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvstate.integrations.sglang import KVStateKVManager, UnsupportedLayoutError
    from tests.integrations.rig import server_args

    sa = server_args("decode", 1)
    setattr(sa, field, value)  # the check reads ServerArgs; no Redis, no buffers needed
    with pytest.raises(UnsupportedLayoutError, match=message):
        KVStateKVManager(KVArgs(), DisaggregationMode.DECODE, sa)


@pytest.mark.parametrize(
    "mode,env,field,message",
    [
        ("prefill", "SGLANG_DISAGG_STAGING_BUFFER", None, "unset SGLANG_DISAGG_STAGING_BUFFER"),
        ("decode", "SGLANG_DISAGG_STAGING_BUFFER", None, "unset SGLANG_DISAGG_STAGING_BUFFER"),
        # a PP prefill is served (test_sglang_across_tp), one with draft KV buffers refused
        ("prefill", None, "pp_size", "size 2 \\(--pp-size\\) and speculative decoding"),
    ],
)
def test_staging_and_pp_prefill_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, mode: str, env: str | None, field: str | None, message: str
) -> None:
    """Issue 29 items 3 and 4: SGLang's staging buffers, and a pipeline-parallel prefill
    whose buffers kvstate cannot name by layer, are refused when the manager starts."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvstate.integrations.sglang import KVStateKVManager, UnsupportedLayoutError
    from tests.integrations.rig import server_args

    sa = server_args(mode, 1)
    if env:
        monkeypatch.setenv(env, "1")
    args = KVArgs()
    if field:
        setattr(sa, field, 2)
        args.num_draft_entries = 1
    with pytest.raises(UnsupportedLayoutError, match=message):
        KVStateKVManager(args, DisaggregationMode(mode), sa)


@pytest.mark.parametrize("kind", ["dsa_tail", "some_future_state"])
def test_state_types_that_are_not_item_lists_are_refused_at_start(kind: str) -> None:
    """dsa_tail's indices are a 6-number descriptor of a ring's live range (SGLang's
    get_dsa_tail_state_indices), not items: moved as items they would put the wrong
    bytes in the decode's pool and report Success, so such a pool is refused."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvstate.integrations.sglang import KVStateKVManager, UnsupportedLayoutError
    from tests.integrations.rig import server_args

    args = KVArgs()
    args.state_types = [StateType.SWA, StateType(kind) if kind == "dsa_tail" else kind]
    for mode in ("prefill", "decode"):
        with pytest.raises(UnsupportedLayoutError, match=f"state type '{kind}'"):
            KVStateKVManager(args, DisaggregationMode(mode), server_args(mode, 1))


def test_a_prefill_is_not_taken_for_fewer_dp_ranks_than_it_has() -> None:
    """A decode that looks a DP prefill up while only DP rank 0 registered must not read
    it as a prefill of one DP rank: it keeps that table, and would bind every request
    to DP rank 0 (seen once as info_dp 1 in test_sglang_across_tp's DP2 shape)."""
    from kvstate.integrations.sglang.ranks import prefill_info
    from kvstate.registry import EngineInfo

    def rank(dp: int) -> EngineInfo:
        layout = {"transport": "kvstate-sglang", "dp": 2, "kv": {"buffers": [{"heads": 1}]}}
        return EngineInfo(f"127.0.0.1:1/dp{dp}/tp0", "prefill", "127.0.0.1:1", "i", layout=layout)

    assert prefill_info([rank(0)]) is None
    info = prefill_info([rank(0), rank(1)])
    assert info is not None and (info.dp_size, info.tp_size, info.page_heads) == (2, 1, 1)
    # a registration without the field (mirror mode: no kvstate spaces) as before
    alone = EngineInfo("127.0.0.1:1/dp0/tp0", "prefill", "127.0.0.1:1", "i")
    assert prefill_info([alone]) is not None


def test_state_counts_per_type_refuse_what_a_flat_list_would_mispair() -> None:
    """Two state types (DeepSeek-V4 registers two SWA components) whose windows differ
    the opposite ways: the flat list a decode published before has the sender's total,
    and paired the first type's second page with the second type's first; each type's
    count refuses the room instead (slots.pack / unpack)."""
    import numpy as np

    from kvstate.integrations.sglang.slots import pack, unpack
    from transports.base import TransportError

    mine = [(0, np.array([5, 6])), (1, np.array([7, 8]))]
    ok = pack([np.array([1, 2]), None, np.array([3, 4])])
    got = unpack(ok, True, [(0, np.array([5, 6])), (2, np.array([7, 8]))], 1, "d")
    assert [g.tolist() for g in got] == [[1, 2], [3, 4]]
    drift = pack([np.array([1]), np.array([2, 3, 4])])
    assert drift is not None
    with pytest.raises(TransportError, match="state type 0: 2 slots here, 1 published by d"):
        unpack(drift, True, mine, 1, "d")
    flat = np.array([1, 2, 3, 4])  # what the flat list let through (an earlier decode)
    assert [g.tolist() for g in unpack(flat, False, mine, 1, "d")] == [[1, 2], [3, 4]]
    with pytest.raises(TransportError, match="state type\\(s\\) \\[1\\], none here"):
        unpack(pack([np.array([1, 2]), np.array([3])]), True, mine[:1], 1, "d")
    with pytest.raises(TransportError, match="malformed"):
        unpack(np.array([2, 1]), True, mine, 1, "d")
