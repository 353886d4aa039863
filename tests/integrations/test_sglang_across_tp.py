"""Attention TP of different sizes on SGLang's own backend classes (issue 29, item 1):
prefill TP 1 -> decode TP 2 and 4, prefill TP 2 and 4 -> decode TP 1, GQA with fewer KV
heads than ranks, MLA; and pipeline-parallel prefills (item 4: each stage sends its own
layers). One process per rank (sglang_tp.py), real Redis, UCX/CMA; every byte of every
decode rank's pool compared; one decode rank's abort fails every rank. And hybrid models'
state slots (item 2, sglang_state.py): the SWA pool's window pages and Mamba slots.

Runs before test_sglang_e2e (file order): that module's servers spin idle until the
session ends and would starve these rank processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvstate.store import connect
from tests.helpers import keys_of, scaled, wait_for

# 8 rank processes, each importing SGLang and torch: minutes on a loaded 2-core host
# (beside the end-to-end tests' idle servers), more than the suite's 300 s per test
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(scaled(900))]
TIMEOUT = 600


def show(url: str, room: int) -> dict[str, Any]:
    cli = [sys.executable, "-m", "kvstate.cli", "--url", url, "show", str(room), "--json"]
    return json.loads(subprocess.run(cli, check=True, capture_output=True, text=True).stdout)


def run_ranks(
    run_rank: Any, url: str, tmp_path: Path, names: list[str], before_clear: Any = None
) -> dict[tuple[str, int], Any]:
    """Four prefill and four decode rank processes running ``run_rank`` over the shapes
    ``names``: each rank's results once all wrote them (``before_clear()`` then runs,
    while the rooms still exist), then the ranks clear and exit."""
    ctx = mp.get_context("spawn")
    procs = {
        (role, r): ctx.Process(target=run_rank, args=(role, r, url, str(tmp_path), names))
        for role in ("prefill", "decode")
        for r in range(4)
    }
    for p in procs.values():
        p.start()
    try:
        for (role, r), p in procs.items():
            path = tmp_path / f"{role}{r}.json"
            assert wait_for(lambda: path.exists() or not p.is_alive(), TIMEOUT), path  # noqa: B023
            assert path.exists(), f"{role} rank {r} exited with {p.exitcode}"
        res = {k: json.loads((tmp_path / f"{k[0]}{k[1]}.json").read_text()) for k in procs}
        if before_clear is not None:
            before_clear()
        (tmp_path / "clear").write_text("1")
        for p in procs.values():
            p.join(TIMEOUT)
    finally:
        for p in procs.values():
            p.kill()
    return res


def test_heterogeneous_tp_and_mla_move_byte_exact(redis_url: str, tmp_path: Path) -> None:
    from tests.integrations.sglang_tp import SHAPES, run_rank

    shown: dict[str, Any] = {}

    def show_all() -> None:
        shown.update({s.name: show(redis_url, s.room(0))["transfer_infos"] for s in SHAPES})

    t0 = time.monotonic()
    res = run_ranks(run_rank, redis_url, tmp_path, [s.name for s in SHAPES], show_all)
    compared = 0
    for s in SHAPES:
        read = s.read()
        for r in range(s.ranks("prefill")):
            got = res[("prefill", r)]
            dp_rank = r // (s.prefill_tp * s.pp)
            if s.room(1) % s.dp == dp_rank:  # SGLang hands the aborted room to this DP rank
                assert got[f"{s.name}:abort"] == 0, (s.name, r)  # a decode rank aborted
                assert "aborted by decode" in got[f"{s.name}:abort:error"]
            if s.room(0) % s.dp != dp_rank:
                assert f"{s.name}:ok" not in got  # the other DP rank's request
                continue
            assert got[f"{s.name}:ok"] == 4, (s.name, r, got)
            moved = got[f"{s.name}:ok:bytes"]
            # a dummy rank moves nothing; a rank read from moves its heads' share
            assert (moved > 0) == (r % (s.prefill_tp * s.pp) // s.pp in read), (s.name, r, moved)
        for r in range(s.decode_tp):
            got = res[("decode", r)]
            assert got[f"{s.name}:info_tp"] == s.prefill_tp
            assert got[f"{s.name}:info_dp"] == s.dp
            assert got[f"{s.name}:ok"] == 4 and got[f"{s.name}:mismatch"] == [], (s.name, r)
            assert got[f"{s.name}:aux"], (s.name, r)  # the aux slot from one sender
            assert got[f"{s.name}:abort"] == 0 and "aborted by decode" in str(got), s.name
            compared += got[f"{s.name}:compared"]
        # every prefill rank's share of the pages is what the decode ranks hold
        total = sum(
            res[("prefill", r)].get(f"{s.name}:ok:bytes", 0) for r in range(s.ranks("prefill"))
        )
        kv_bytes = 2 * 2 if not s.mla else 2  # buffers
        per_page = 4 * 8 * (1 if s.mla else 2)  # tokens x DIM x the model's heads
        copies = s.decode_tp if s.mla else max(1, s.decode_tp // s.kv_heads)
        assert total == 5 * kv_bytes * per_page * copies, (s.name, total)
    print(f"SGLang TP shapes: {compared} KV bytes compared in {time.monotonic() - t0:.0f}s")
    a = "127.0.0.1:19104"  # 4 prefill ranks (2 KV heads, each on two) to 1 decode rank
    d0 = "decode@127.0.0.1:19204/dp0/tp0"
    assert {(tx, rx): i["moves"] for tx, per in shown["4->1"].items() for rx, i in per.items()} == {
        (f"{a}/dp0/tp0", d0): "heads 0-0 -> 0-0",
        (f"{a}/dp0/tp1", d0): "nothing (dummy)",
        (f"{a}/dp0/tp2", d0): "heads 0-0 -> 1-1",
        (f"{a}/dp0/tp3", d0): "nothing (dummy)",
    }
    a = "127.0.0.1:19102"
    assert {(tx, rx): i["moves"] for tx, per in shown["1->4"].items() for rx, i in per.items()} == {
        (f"{a}/dp0/tp0", f"decode@127.0.0.1:19202/dp0/tp{r}"): f"heads {r // 2}-{r // 2} -> 0-0"
        for r in range(4)
    }
    # the DP shape's ok room (bootstrap_room % 2 == 0) bound to DP rank 0's sender only
    assert set(shown["DP2 1->1"]) == {"127.0.0.1:19109/dp0/tp0"}
    assert keys_of(connect(redis_url)) == []


def test_state_slots_move_byte_exact(redis_url: str, tmp_path: Path) -> None:
    from tests.integrations.sglang_state import (
        MAMBA_BYTES,
        SHAPES,
        SWA_DIM,
        SWA_LAYERS,
        SWA_SRC,
        run_rank,
    )
    from tests.integrations.sglang_tp import DIM, LAYERS, SRC, TOKENS

    t0 = time.monotonic()
    res = run_ranks(run_rank, redis_url, tmp_path, [s.name for s in SHAPES])
    for s in SHAPES:
        kv = s.kv
        for r in range(kv.decode_tp):
            got = res[("decode", r)]
            # the pools at the poll that reported the outcome: the room's pages and
            # slots exact, nothing elsewhere (nothing at all in a refused room)
            assert got[f"{s.name}:mismatch"] == [], (s.name, r)
            if s.refused:
                assert got[s.name] == 0 and s.refused in got[f"{s.name}:error"], (s.name, r)
                assert not got[f"{s.name}:aux"], (s.name, r)
                continue
            assert got[s.name] == 4, (s.name, r, got.get(f"{s.name}:error"))
            assert got[f"{s.name}:aux"], (s.name, r)
        moved = sum(res[("prefill", r)][f"{s.name}:bytes"] for r in range(kv.prefill_tp))
        for r in range(kv.prefill_tp):
            got = res[("prefill", r)]
            if s.refused:  # the decode's refusal fails the prefill's room too
                assert got[s.name] == 0 and s.refused in got[f"{s.name}:error"], (s.name, r)
            else:
                assert got[s.name] == 4, (s.name, r)
        # KV bytes (the sender's metric counts KV pages): every head once per decode
        # rank; none where the decode refused before publishing its pages
        copies = max(1, kv.decode_tp // kv.kv_heads)  # GQA: a head on several ranks
        kv_bytes = len(SRC) * 2 * LAYERS * TOKENS * DIM * kv.kv_heads * copies
        want = 0 if s.refused and not s.drift else kv_bytes
        assert moved == want, (s.name, moved)
    swa = len(SWA_SRC) * 2 * SWA_LAYERS * TOKENS * SWA_DIM * 2
    print(
        f"SGLang state shapes: SWA {swa} B and Mamba {MAMBA_BYTES} B per room compared "
        f"in {time.monotonic() - t0:.0f}s"
    )
    assert keys_of(connect(redis_url)) == []
