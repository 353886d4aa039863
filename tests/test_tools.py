"""Smoke tests of the benchmarks under tools/: each runs as a subprocess in a configuration
of a few seconds and checks the JSON it prints (keys, types, sane values), so a change
that breaks a benchmark fails here instead of on the next measuring day.

The figures of such short runs mean nothing; only their shape and sanity are checked.
The peers (NIXL, Mooncake) are not installed in the test environment: the tool skips
them with a note, which is checked too; where they are installed, their rows are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstate.keys import TRACKER_SHARDS
from kvstate.store.functions import FUNCTIONS
from kvstate.store.scripts import SHAS
from tests.helpers import scaled
from tools.bench.transfer.systems import available, systems

ROOT = Path(__file__).resolve().parents[1]
TINY_TRANSFER = ("--json", "--reps", "1", "--layers", "1", "--pages", "64", "--page-kib", "4")


def run_tool(script: str, *args: str, timeout: float = 180) -> tuple[dict[str, Any], int]:
    """The JSON document ``tools/<script> args`` prints, and the tool's process id."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} did not finish:\n{err[-4000:]}")
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{err[-4000:]}"
    doc: dict[str, Any] = json.loads(out)
    return doc, proc.pid


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def assert_positive(doc: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert positive(doc[key]), (key, doc[key])


def assert_median_range(doc: dict[str, Any], key: str) -> None:
    """A ratio reported as the median of rounds with its [min, max] beside it."""
    low, high = doc[f"{key}_range"]
    assert positive(doc[key]) and 0 < low <= doc[key] <= high, (key, doc[key], low, high)


# -- tools/bench_state.py ---------------------------------------------------------------------
@pytest.mark.redis
def test_bench_state_smoke() -> None:
    """Every part but the Cluster (test_lean runs --quick with it): standalone figures,
    client processes, FCALL against EVAL, durable mode and the trace."""
    doc, _ = run_tool("bench_state.py", "--smoke", "--json", "--no-cluster")
    assert set(doc) == {"standalone", "fcall_vs_eval", "durable", "trace", "command"}
    assert doc["command"] == "python tools/bench_state.py --smoke --lifecycles 2000"

    s = doc["standalone"]
    assert isinstance(s["round_trips_per_lifecycle"], int)
    assert_positive(
        s,
        "round_trips_per_lifecycle",
        "round_trips_per_16_batched_lifecycles",
        "single_lifecycles_per_s",
        "batched_lifecycles_per_s",
        "ping_redis_py_unix_per_s",
        "ping_raw_tcp_per_s",
        "batched_busiest_primary_cpu_us_per_lifecycle",
    )
    for kind in ("single", "batched"):
        for what in ("redis_cmd_us", "redis_cpu_us", "redis_commands", "script_calls"):
            assert_positive(s, f"{kind}_{what}_per_lifecycle")
        for bound in ("unix", "raw_tcp"):
            assert_median_range(s, f"{kind}_ratio_to_ping_bound_{bound}")
    assert s["ping_rounds"] >= 8
    for n in ("1_rooms", "64_rooms", "256_rooms"):
        step = s["round_trips_per_step"][n]
        assert set(step) == {"poll_many", "begin_many", "finish_many", "clear_many"}
        assert all(isinstance(v, int) for v in step.values()), step
        # a poll_many of rooms that wait (nobody changed them since the last): no round
        # trip with change notices (docs/design.md, "Change notices"), one per node without
        assert step["poll_many"] in (0, 1) and min(step.values()) >= 0, step
        assert all(v >= 1 for k, v in step.items() if k != "poll_many"), step
    scripts = s["script_us_per_call"]
    assert set(scripts) & (set(SHAS) | set(FUNCTIONS)), scripts  # named, not by SHA
    assert all(isinstance(v, float) and v >= 0 for v in scripts.values()), scripts

    mem = s["room_memory"]
    assert mem["held_rooms"] == [64, 256]
    assert {"room", "rx", "tx"} <= set(mem["keys"]), mem["keys"]
    assert all(positive(k["bytes"]) for k in mem["keys"].values()), mem["keys"]
    assert_positive(mem, "used_memory_bytes_per_room", "memory_usage_bytes_per_room")
    assert mem["keys_per_room"] >= 3, mem
    assert s["room_memory_bytes"] == mem["used_memory_bytes_per_room"]
    assert s["room_memory_usage_bytes"] == mem["memory_usage_bytes_per_room"]
    assert s["room_keys"] == 3

    assert set(s["processes"]) == {"1_procs"}
    assert_positive(
        s["processes"]["1_procs"],
        "lifecycles_per_s",
        "redis_cpu_us_per_lifecycle",
        "busiest_primary_cpu_us_per_lifecycle",
    )

    fe = doc["fcall_vs_eval"]
    assert fe["rounds"] >= 10
    for kind in ("single", "batched"):
        for what in ("cmd", "cpu"):
            assert_positive(
                fe,
                f"{kind}_fcall_redis_{what}_us_per_lifecycle",
                f"{kind}_eval_redis_{what}_us_per_lifecycle",
            )
            assert_median_range(fe, f"{kind}_redis_{what}_fcall_over_eval")

    assert set(doc["durable"]) == {"standalone"}
    du = doc["durable"]["standalone"]
    for mode in ("plain", "durable"):
        assert_positive(
            du,
            f"{mode}_round_trips_per_lifecycle",
            f"{mode}_single_lifecycles_per_s",
            f"{mode}_batched_lifecycles_per_s",
            f"{mode}_redis_cmd_us_per_lifecycle",
            f"{mode}_redis_cpu_us_per_lifecycle",
            f"{mode}_replica_cpu_us_per_lifecycle",
        )
    for kind in ("single", "batched"):
        low, high = du[f"{kind}_durable_vs_plain_range"]
        assert 0 < low <= du[f"{kind}_durable_vs_plain_median"] <= high
    assert_positive(du, "lifecycles_per_mode", "rounds")

    assert set(doc["trace"]) == {"standalone"}
    tr = doc["trace"]["standalone"]
    for mode in ("off", "default", "full"):
        assert_positive(
            tr,
            f"{mode}_round_trips_per_lifecycle",
            f"{mode}_redis_cmd_us_per_lifecycle",
            f"{mode}_redis_cpu_us_per_lifecycle",
            f"{mode}_commands_per_lifecycle",
        )
    assert_positive(tr, "trace_bytes_per_room", "trace_entries_per_room", "default_rate")
    for mode in ("default", "full"):
        for kind in ("single", "batched"):
            low, high = tr[f"{kind}_{mode}_vs_off_range"]
            assert 0 < low <= tr[f"{kind}_{mode}_vs_off_median"] <= high


@pytest.mark.redis
def test_bench_state_rooms_per_step_smoke() -> None:
    doc, _ = run_tool("bench_state.py", "--rooms-per-step", "4", "16", "--no-cluster", "--json")
    assert set(doc) == {"standalone", "command"}
    assert doc["command"] == "python tools/bench_state.py --rooms-per-step 4 16 --no-cluster"
    assert set(doc["standalone"]) == {"4_rooms", "16_rooms"}
    for step in doc["standalone"].values():
        assert isinstance(step["round_trips_per_step"], int)
        assert isinstance(step["heartbeat_round_trips_meanwhile"], int)
        assert_positive(
            step,
            "round_trips_per_step",
            "redis_cmd_us_per_lifecycle",
            "redis_cpu_us_per_lifecycle",
            "redis_commands_per_lifecycle",
            "lifecycles_per_s",
        )
        assert step["step_s"] >= 0


@pytest.mark.redis
def test_bench_state_tp_shapes_smoke() -> None:
    """Heterogeneous TP rooms against equal-TP ones: every shape's round trips per rank
    and Redis CPU per rank pair, and a ratio per heterogeneous shape."""
    doc, _ = run_tool("bench_state.py", "--tp-shapes", "--smoke", "--json")
    assert doc["command"] == "python tools/bench_state.py --tp-shapes --smoke"
    assert doc["batch"] == 4 and doc["rounds"] == 2 and len(doc["loadavg"]) == 3
    shapes = {"2x2", "4x4", "2x4", "4x2", "1x4", "4x1"}
    assert shapes <= set(doc)
    for name in shapes:
        s = doc[name]
        assert (s["prefill_tp"], s["decode_tp"]) == tuple(map(int, name.split("x")))
        assert s["rank_pairs"] >= max(s["prefill_tp"], s["decode_tp"])
        # every rank's trips per step are the same whatever the room's size
        assert len(s["round_trips_per_step_prefill_rank"]) == 1, s
        assert len(s["round_trips_per_step_decode_rank"]) == 1, s
        assert_positive(
            s,
            "round_trips_per_step_max_rank",
            "redis_cpu_us_per_room",
            "redis_cpu_us_per_rank_pair",
            "redis_cpu_us_per_participant",
            "rooms_per_s",
        )
    assert set(doc["ratios"]) == {"2x4_vs_4x4", "4x2_vs_4x4", "1x4_vs_4x4", "4x1_vs_4x4"}
    for ratio in doc["ratios"].values():
        # round trips are counts, not timings: a shape that made more would show here
        assert ratio["round_trips_per_step_max_rank"] == 1.0, ratio
        assert_positive(ratio, "redis_cpu_per_rank_pair", "redis_cpu_per_participant")


# -- tools/bench_vllm_steps.py, tools/bench_sglang_steps.py -----------------------------------
STEP_PHASES = {"prefill_admit", "prefill_held", "decode_admit", "decode_loading", "lifecycle"}


@pytest.mark.vllm
@pytest.mark.redis
def test_bench_vllm_steps_smoke() -> None:
    """vLLM's schedulers with kvstate's connector and NixlConnector: every phase at
    every count, hook times and round trips per step, the ratios and the targets. Round
    trips are counts (not timings): with nothing in flight a step makes none. NIXL's
    worker side runs where NIXL is installed (not in CI's vLLM venv)."""
    pytest.importorskip("vllm")
    doc, _ = run_tool("bench_vllm_steps.py", "--smoke", "--layers", "3", "--json", timeout=300)
    assert doc["command"] == "python tools/bench_vllm_steps.py --smoke --layers 3"
    assert doc["counts"] == [0, 1, 4] and doc["steps_per_phase"] == 2 and doc["layers"] == 3
    assert set(doc["phases"]) == STEP_PHASES
    nixl_worker = doc["nixl_worker_side"]
    assert nixl_worker is (importlib.util.find_spec("nixl") is not None)
    for connector in ("kvstate", "nixl"):
        worker = connector == "kvstate" or nixl_worker
        assert set(doc["vllm"][connector]) == {"0", "1", "4"}
        for n, phases in doc["vllm"][connector].items():
            assert set(phases) == STEP_PHASES
            for phase, s in phases.items():
                # nothing to admit or conclude with no request; without a worker side
                # NIXL's loads never end
                idle = n == "0" and phase in ("prefill_admit", "lifecycle")
                if idle or (phase == "lifecycle" and not worker):
                    assert s == {"steps": 0}, (connector, n, phase, s)
                    continue
                assert s["steps"] >= 1, (connector, n, phase)
                assert s["sched_hooks_us_median"] > 0 and s["all_hooks_us_mean"] > 0, s
                assert isinstance(s["round_trips_max"], int) and s["round_trips_max"] >= 0
                assert "build_connector_meta" in s["hook_calls"], s
                if not worker:
                    assert s["worker_hooks_us_median"] == 0 and s["round_trips_max"] == 0, s
                else:
                    assert s["hook_calls"]["get_finished"] == s["steps"], s
                if connector == "nixl":
                    assert s["round_trips_max"] == 0, s
                assert s["wall_ms"] > 0 and s["behind_ms_total"] >= 0, s
    kv = doc["vllm"]["kvstate"]
    # kvstate's hooks make no round trip: its worker's work runs behind the step
    assert all(s["round_trips_max"] == 0 for p in kv.values() for s in p.values() if s["steps"])
    assert all(s["round_trips_behind"] == 0 for s in kv["0"].values() if s["steps"])
    for n in ("1", "4"):  # rooms in flight: at most one round trip a run (none on a
        # run whose change notices name no room and no sweep is due)
        assert kv[n]["prefill_held"]["round_trips_behind_max"] in (0, 1)
        assert kv[n]["decode_loading"]["round_trips_behind_max"] in (0, 1)
    assert kv["4"]["lifecycle"]["push_steps"] >= 1
    assert doc["targets"]["round_trips_idle_target_met"] is True
    for n in ("1", "4"):
        for phase in ("prefill_held", "decode_admit", "decode_loading"):
            ratio = doc["ratios_kvstate_over_nixl"][n][phase]
            assert_positive(ratio, "sched_over_nixl_sched")
            assert ("all_over_nixl_all" in ratio) is nixl_worker, ratio


@pytest.mark.sglang
@pytest.mark.redis
def test_bench_sglang_steps_smoke() -> None:
    """SGLang's poll_and_all_reduce over kvstate's senders and receivers: no round trip
    with no room, at most one per step whatever the count (none on a step where change
    notices name no room and no sweep is due), against one per room polled alone."""
    pytest.importorskip("sglang")
    doc, _ = run_tool("bench_sglang_steps.py", "--smoke", "--json", timeout=300)
    assert doc["command"] == "python tools/bench_sglang_steps.py --smoke"
    rows = doc["standalone (1 node)"]
    assert [r["rooms"] for r in rows] == [0, 1, 4]
    for r in rows:
        n = r["rooms"]
        for side in ("prefill_step", "decode_step"):
            assert (0 < r[side] <= 1) if n else r[side] == 0, r
        assert r["prefill_step_per_room_poll"] == r["decode_step_per_room_poll"] == n, r
        assert r["prefill_step_us"] > 0 and r["decode_step_us"] > 0, r
        if n:
            assert_positive(r, "ratio_prefill", "ratio_prefill_us", "ratio_decode_us")


# -- tools/gpu_check.py (its host dry run: the GPU host runs the rest) -------------------------
def test_gpu_check_host_dry_run() -> None:
    """The device-memory check's plumbing on host memory: kvstate's UCX put path (and
    NIXL's, where installed) verified byte for byte, the ratio, and the UCX transports
    each side's endpoints logged."""
    doc, _ = run_tool(
        "gpu_check.py",
        *("--host-dry-run", "--nixl", "--ucx-lanes", "--json", "--reps", "1"),
        *("--layers", "1", "--pages", "64", "--page-kib", "4"),
    )
    assert doc["memory"] == "host (dry run)" and doc["arrays"] == "numpy"
    systems = {"kvstate", "nixl"} if available("nixl") else {"kvstate"}
    assert set(doc["results"]) == systems
    for out in doc["results"].values():
        assert set(out) == {"contiguous", "fragmented"}
        assert all(r["verified"] is True and positive(r["gbps"]) for r in out.values()), out
    if "nixl" in systems:
        assert_positive(doc["ratios_kvstate_over_nixl"], "contiguous", "fragmented")
    else:
        assert any("NIXL not installed" in n for n in doc["notes"]), doc["notes"]
    # the kvstate side's endpoint configuration, as UCX logged it (put lanes included)
    lanes = doc["ucx_lanes"]["kvstate"]
    assert any(line.startswith(("intra-node", "inter-node")) for line in lanes), lanes
    assert any(line.startswith("put") for line in lanes), lanes


@pytest.mark.redis
def test_bench_state_pairs_smoke() -> None:
    """Engine pairs on a 3-primary Cluster against one standalone server (issue 33):
    per-primary CPU, the ratios with their baselines, where each pair's tracker landed."""
    doc, _ = run_tool("bench_state.py", "--pairs", "2", "--smoke", "--json", timeout=300)
    assert doc["command"] == (
        "python tools/bench_state.py --pairs 2 --rounds 6 --lifecycles 2000 --batch 16 "
        "--placement named --smoke"
    )
    assert doc["pairs"] == 2 and doc["rounds"] == 2
    assert len(doc["index_primary_of_each_pair"]) == 2
    assert sum(doc["indexes_per_primary"]) == 2
    assert sum(doc["tracker_shards_per_primary"]) == 2 * (TRACKER_SHARDS + 1)
    assert all(doc["tracker_shards_per_primary"]), doc  # spread over every primary
    for name, primaries_ in (
        ("standalone_tcp", 1),
        ("standalone_unix", 1),
        ("cluster1", 1),
        ("cluster3", 3),
        ("cluster3_one", 3),
    ):
        d = doc[name]
        assert d["lifecycles"] == 2 * 2 * 16, d
        assert len(d["primary_cpu_us_per_lifecycle"]) == primaries_
        assert_positive(
            d,
            "lifecycles_per_s",
            "redis_cpu_us_per_lifecycle",
            "busiest_primary_cpu_us_per_lifecycle",
        )
        assert d["busiest_over_mean"] >= 1.0
    one = doc["cluster3_one"]["primary_cpu_us_per_lifecycle"]  # every key on the first
    assert one[0] > 3 * max(one[1:]), one
    for name in ("standalone_tcp", "cluster3"):
        assert_positive(doc[name], "room_memory_bytes", "room_memory_usage_bytes")
    for ratio in doc["ratios"].values():
        low, high = ratio["range"]
        assert 0 < low <= ratio["median"] <= high, ratio
    assert set(doc["ratios"]) == {
        "cluster_busiest_over_mean",
        "scale_out_by_busiest_primary_cpu_vs_standalone_tcp",
        "scale_out_by_busiest_primary_cpu_vs_standalone_unix",
        "cluster_total_cpu_over_standalone_tcp",
        "cluster_total_cpu_over_standalone_unix",
        "one_node_cluster_cpu_over_standalone_tcp",
        "cluster_on_one_primary_cpu_over_standalone_tcp",
        "cluster_total_cpu_over_cluster_on_one_primary",
    }


# -- tools/bench_aborts.py --------------------------------------------------------------------
@pytest.mark.redis
def test_bench_aborts_smoke() -> None:
    """abort_many makes the same round trips for 1 room and for 4 (an abort() each, 3
    a room), and a restarted rank clears what its predecessor left in as many trips
    whatever their number; every room it made was failed and cleared."""
    doc, _ = run_tool("bench_aborts.py", "--smoke", "--json")
    assert doc["command"] == "python tools/bench_aborts.py --smoke" and doc["reps"] == 1
    rows = {r["rooms"]: r for r in doc["aborts"]}
    assert set(rows) == {1, 4}
    for n, r in rows.items():
        assert_positive(r, "one_by_one_ms", "abort_many_ms", "one_by_one_over_abort_many")
        assert r["one_by_one_round_trips"] == 3 * n and r["abort_many_round_trips"] == 3
    cleared = {r["rooms"]: r for r in doc["predecessor"]}
    assert all(r["cleared"] == n for n, r in cleared.items())
    assert cleared[1]["round_trips"] == cleared[4]["round_trips"]


# -- tools/bench_plan.py ----------------------------------------------------------------------
def test_bench_plan_smoke() -> None:
    """Every shape's plan (kept and first room) and the copy it plans, which moved the
    bytes it says into the pages (and heads) named: its spans, one per buffer and run."""
    pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")
    doc, _ = run_tool("bench_plan.py", "--smoke", "--json")
    assert doc["command"] == "python tools/bench_plan.py --smoke" and doc["reps"] == 3
    rows = {(r["buffers"], r["pages"], r["fragmented"], r["heads"]): r for r in doc["rows"]}
    assert set(rows) == {(2, 4, False, None), (64, 4, False, None), (64, 64, True, None),
                         (64, 64, True, 2), (160, 16, False, None)}  # fmt: skip
    for (buffers, pages, _, heads), r in rows.items():
        assert_positive(r, "plan_us", "plan_first_room_us", "copy_us", "plan_over_copy")
        assert r["bytes"] == buffers * pages * 256 // (2 if heads else 1)
        assert r["copied"] is True
    assert rows[(64, 4, False, None)]["spans"] == 64  # one run of 4 pages per buffer


# -- tools/bench_transfer.py ------------------------------------------------------------------
ROW_KEYS = {
    "mode",
    "system",
    "label",
    "path",
    "family",
    "settings",
    "case",
    "gbps",
    "gbps_min",
    "gbps_max",
    "median_ms",
    "reps",
    "verified",
    "rss_mib",
}


def check_transfer_doc(doc: dict[str, Any], modes: list[str]) -> dict[tuple[str, str], Any]:
    """The document's shape and every row's sanity; the rows by (system, case)."""
    assert set(doc) == {
        "config",
        "modes",
        "results",
        "ratios",
        "best",
        "ratios_each_setting",
        "notes",
        "loadavg",
        "wall_s",
    }
    assert doc["modes"] == modes
    assert doc["config"] == {
        "layers": 1,
        "pages": 64,
        "page_bytes": 4096,
        "reps": 1,
        "warmup": 2,
        "total_bytes": 64 * 4096,
        "fragmented_runs_per_layer": doc["config"]["fragmented_runs_per_layer"],
    }
    assert 1 < doc["config"]["fragmented_runs_per_layer"] <= 64
    assert positive(doc["wall_s"]) and len(doc["loadavg"]["start"]) == 3
    rows: dict[tuple[str, str], Any] = {}
    for r in doc["results"]:
        assert set(r) == ROW_KEYS, r
        assert r["mode"] in modes and r["reps"] == 1, r
        assert 0 < r["gbps_min"] <= r["gbps"] <= r["gbps_max"], r
        assert positive(r["median_ms"]), r
        if r["system"] == "memcpy-alone":  # in the main process: nothing to verify
            assert r["verified"] is None and r["rss_mib"] is None, r
        else:
            assert r["verified"] is True, r
            assert positive(r["rss_mib"]["tx"]) and positive(r["rss_mib"]["rx"]), r
        rows[(r["system"], r["case"])] = r
    for key, hit in doc["best"].items():
        assert key.split()[0] in modes and positive(hit["gbps"]), (key, hit)
    for key, value in doc["ratios_each_setting"].items():
        assert value is None or positive(value), (key, value)
    return rows


def check_peers(doc: dict[str, Any], mode: str, ratios: dict[str, Any]) -> None:
    """NIXL and Mooncake: a note each when not installed (and no ratio), else rows."""
    for family, name in (("nixl", "NIXL"), ("mooncake", "Mooncake")):
        peer = [k for k in ratios if f"/ {name} (best" in k]
        assert peer, (family, list(ratios))
        if available(family):
            assert any(r["family"] == family for r in doc["results"]), family
            continue
        assert any(n.startswith(f"{mode}: ") and "not installed" in n for n in doc["notes"])
        assert all(ratios[k] is None for k in peer), {k: ratios[k] for k in peer}


@pytest.mark.redis
def test_bench_transfer_same_host_smoke() -> None:
    """One pair of each kind kvstate runs here (the kvstate CMA path, raw ucxx, the
    socket, memcpy) and an --extra row; the UCX put path runs in the cross-host test."""
    doc, _ = run_tool(
        "bench_transfer.py",
        *TINY_TRANSFER,
        "--mooncake-lanes",
        "1",
        "--skip",
        "kvstate-ucx,ucxx-eh",
        "--extra",
        "cma1:KVSTATE_UCX_CMA=1,KVSTATE_CMA_THREADS=1",
    )
    rows = check_transfer_doc(doc, ["same-host"])
    layouts = ("contiguous", "fragmented")
    want = {(s, c) for s in ("kvstate-cma", "kvstate-cma1", "socket", "memcpy") for c in layouts}
    want |= {("ucxx", "one message")} | {("memcpy-alone", c) for c in layouts}
    assert want <= set(rows), sorted(rows)
    assert not {k for k in rows if k[0] in ("kvstate-ucx", "ucxx-eh")}, sorted(rows)
    assert rows[("kvstate-cma", "contiguous")]["path"] == "CMA"
    assert rows[("kvstate-cma1", "fragmented")]["settings"] == {
        "KVSTATE_UCX_CMA": "1",
        "KVSTATE_CMA_THREADS": "1",
    }
    assert doc["notes"][0] == "same-host: one host, loopback / shared memory"
    assert any("skipped (--skip)" in n and "UCX put path" in n for n in doc["notes"])
    ratios = doc["ratios"]
    for case in layouts:
        for peer in ("memcpy (timed in turn)  [>= 0.9]", "raw ucxx one message  [>= 0.9]"):
            assert positive(ratios[f"same host {case}: kvstate CMA / {peer}"]), ratios
        assert positive(ratios[f"same host {case}: kvstate CMA / plain socket"])
        assert positive(ratios[f"same host {case}: kvstate CMA / memcpy alone after the run"])
    check_peers(doc, "same-host", ratios)


@pytest.mark.redis
def test_bench_transfer_cross_host_smoke() -> None:
    """kvstate's UCX put path between two network namespaces (or, without root or
    ``ip``, the loopback fallback the tool names); the namespaces are removed after."""
    doc, pid = run_tool(
        "bench_transfer.py",
        *TINY_TRANSFER,
        "--cross-host",
        "--mooncake-lanes",
        "1",
        "--skip",
        "ucxx,ucxx-eh,socket",
    )
    rows = check_transfer_doc(doc, ["cross-host"])
    assert set(rows) == {("kvstate-ucx", "contiguous"), ("kvstate-ucx", "fragmented")} | {
        k for k in rows if k[0].startswith(("nixl", "mooncake"))
    }
    row = rows[("kvstate-ucx", "fragmented")]
    assert row["path"] == "UCX"
    assert row["settings"] == {"KVSTATE_UCX_CMA": "0", "UCX_TLS": "tcp"}
    site = doc["notes"][0]
    assert site.startswith(
        ("cross-host: two network namespaces", "cross-host: network namespaces unavailable")
    ), site
    ratios = doc["ratios"]
    assert set(ratios) == {
        f"cross-host {case}: kvstate UCX / {peer}"
        for case in ("contiguous", "fragmented")
        for peer in (
            "NIXL (best setting)  [>= 1.0]",
            "Mooncake (best lane count)  [>= 1.0]",
            "raw ucxx one message  [>= 0.8]",
            "plain socket",
        )
    }
    check_peers(doc, "cross-host", ratios)
    if shutil.which("ip") and os.geteuid() == 0:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"kvb{pid}" not in listed, listed


def test_transfer_systems_follow_the_flags() -> None:
    """--extra rows and --mooncake-lanes, per mode: a CMA extra only on one host, every
    row's key unique (--skip and the JSON name rows by it)."""
    extras = (("cma1", {"KVSTATE_UCX_CMA": "1"}), ("chunk0", {"KVSTATE_UCX_PUT_CHUNK": "0"}))
    same = {s.key: s for s in systems("same-host", [1, 4], extras)}
    cross = {s.key: s for s in systems("cross-host", [2], extras)}
    assert len(same) == len(systems("same-host", [1, 4], extras))
    assert {"kvstate-cma", "kvstate-cma1", "kvstate-chunk0", "memcpy"} <= set(same)
    assert {"mooncake-1", "mooncake-4"} <= set(same) and "mooncake-2" not in same
    assert same["kvstate-cma1"].path == "CMA" and same["kvstate-chunk0"].path == "UCX"
    assert not {"kvstate-cma", "kvstate-cma1", "memcpy"} & set(cross)
    assert cross["kvstate-chunk0"].env == {
        "KVSTATE_UCX_CMA": "0",
        "UCX_TLS": "tcp",
        "KVSTATE_UCX_PUT_CHUNK": "0",
    }
    ucx_users = [s for s in cross.values() if s.kind in ("kvstate", "ucxx", "nixl")]
    assert all(s.env.get("UCX_TLS") == "tcp" for s in ucx_users), ucx_users
