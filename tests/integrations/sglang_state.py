"""SGLang ranks with state pools (hybrid models), for test_sglang_across_tp.py: an SWA pool
(the sliding-window layers' own KV pages, SGLang's ``StateType.SWA``) or a Mamba pool
(one slot per request, ``StateType.MAMBA``) beside the KV pool, at equal and at
different attention TP sizes.

What each rank hands the backend is what SGLang 0.5.23 builds (``disaggregation/utils.py``
``append_state_component``, ``mem_cache/swa_memory_pool.py``): for SWA, the SWA pool's
``get_contiguous_buf_infos()`` (every SWA layer's K buffer, then every V buffer, a page
being ``[page_size tokens, local KV heads, head_dim]``, ``swa_kv_cache_layout`` "nhd"),
and as state indices the window's pages in the SWA pool (prefill.py / decode.py
``_swa_payload``: its own page numbering, fewer pages than the KV pages); for Mamba, one
buffer per state tensor, an item per request slot, one slot index per request.

One process per rank, holding that rank of every shape (sglang_tp.py's scheme). A decode
rank compares every byte of its KV, SWA and Mamba pools at the poll that reports the
room's Success: the room's pages and slots hold the prefill's bytes of its own heads,
every other page and slot is still zero. Module-level functions so that ``spawn`` can
import them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.integrations.rig import sglang
from tests.integrations.sglang_tp import (
    AUX_SLOTS,
    DIM,
    DST,
    GARBAGE,
    LAYERS,
    PAGES,
    SRC,
    TOKENS,
    Shape,
    fill_meta,
    pattern,
    report_then_clear,
    slot,
)

SWA_PAGES, SWA_LAYERS, SWA_DIM = 8, 2, 4  # the SWA pool: its pages, layers, bytes per head
SWA_SRC = np.array([6, 1], np.int32)  # the window's last pages in the prefill's SWA pool
SWA_DST = np.array([2, 7], np.int32)  # where they land in each decode rank's SWA pool
MAMBA_SLOTS, MAMBA_BYTES = 4, 24  # one tensor; an item per request slot
MAMBA_SRC, MAMBA_DST = 3, 1


@dataclass(frozen=True)
class StateShape:
    """A pair of TP groups (``sglang_tp.Shape``: sizes, KV heads, bootstrap port), the
    state pool both sides hold, and the reason a decode refuses the room with ('' for
    a room that moves)."""

    kv: Shape
    state: str  # "swa" or "mamba"
    refused: str = ""
    drift: bool = False  # the decode's window is a page shorter than the prefill's

    @property
    def name(self) -> str:
        return self.kv.name


MAMBA_REFUSED = "Mamba state slots between attention TP {} (prefill 127.0.0.1:{}) and {}"
SHAPES = [
    StateShape(Shape("SWA 1->1", 1, 1, 2, False, 19121), "swa"),
    StateShape(Shape("SWA 2->2", 2, 2, 2, False, 19122), "swa"),
    StateShape(Shape("Mamba 2->2", 2, 2, 2, False, 19123), "mamba"),
    # across TP sizes SWA pages are sliced by KV heads as the KV pages are
    StateShape(Shape("SWA 1->2", 1, 2, 2, False, 19124), "swa"),  # a head to each rank
    StateShape(Shape("SWA 2->1", 2, 1, 2, False, 19125), "swa"),  # a head from each rank
    # GQA: each of the 2 heads on two decode ranks; two prefill ranks send, two are dummies
    StateShape(Shape("SWA 1->4", 1, 4, 2, False, 19129), "swa"),
    StateShape(Shape("SWA 4->1", 4, 1, 2, False, 19130), "swa"),
    # Mamba tensors are sharded per rank in ways kvstate does not reslice: refused
    StateShape(
        Shape("Mamba 1->2", 1, 2, 2, False, 19126), "mamba", MAMBA_REFUSED.format(1, 19126, 2)
    ),
    StateShape(
        Shape("Mamba 2->1", 2, 1, 2, False, 19127), "mamba", MAMBA_REFUSED.format(2, 19127, 1)
    ),
    # windows of different lengths: which pages pair up is not known; refused, not cut
    StateShape(
        Shape("SWA drift", 1, 1, 2, False, 19128),
        "swa",
        "state type 0: 2 slots here, 1 published",
        True,
    ),
]


def swa_cube(buf: int, pages: np.ndarray, heads: list[int]) -> np.ndarray:
    """SWA buffer ``buf``'s bytes of ``pages`` holding ``heads``: [page, token, head,
    dim], other numbers than the KV pool's (``pattern``) so a swap of the two shows."""
    page = pages.astype(np.int64)[:, None, None, None]
    tok = np.arange(TOKENS)[None, :, None, None]
    head = np.asarray(heads)[None, None, :, None]
    dim = np.arange(SWA_DIM)[None, None, None, :]
    return ((buf * 53 + page * 29 + tok * 11 + head * 17 + dim * 3 + 5) % 241).astype(np.uint8)


def mamba_item(rank: int, slot_index: int) -> np.ndarray:
    """A prefill TP rank's Mamba slot: its own bytes (each rank holds its own shard)."""
    return ((np.arange(MAMBA_BYTES) * 7 + rank * 41 + slot_index * 13 + 1) % 256).astype(np.uint8)


class StateSide:
    """One rank of one shape: KV pool, metadata buffers, state pool, SGLang manager."""

    def __init__(self, sg: Any, shape: StateShape, role: str, rank: int) -> None:
        import torch
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import MetadataBuffers

        from tests.integrations.rig import server_args

        kv = shape.kv
        self.shape, self.role, self.rank = shape, role, rank
        h = kv.heads(role)
        self.heads = [kv.first(role, rank) + k for k in range(h)]
        reads = role == "prefill" and rank in kv.read()
        self.kv = [
            torch.zeros(PAGES * kv.page_bytes(role), dtype=torch.uint8) for _ in range(2 * LAYERS)
        ]
        swa_page = TOKENS * h * SWA_DIM
        self.swa = [
            torch.zeros(SWA_PAGES * swa_page, dtype=torch.uint8) for _ in range(2 * SWA_LAYERS)
        ]
        self.mamba = torch.zeros(MAMBA_SLOTS * MAMBA_BYTES, dtype=torch.uint8)
        if role == "prefill":
            for b, t in enumerate(self.kv):
                cube = pattern(kv, b, np.arange(PAGES), self.heads)
                t.copy_(torch.from_numpy(cube.reshape(-1))) if reads else t.fill_(GARBAGE)
            for b, t in enumerate(self.swa):
                cube = swa_cube(b, np.arange(SWA_PAGES), self.heads)
                t.copy_(torch.from_numpy(cube.reshape(-1))) if reads else t.fill_(GARBAGE)
            items = np.stack([mamba_item(rank, s) for s in range(MAMBA_SLOTS)])
            self.mamba.copy_(torch.from_numpy(items.reshape(-1)))
        self.meta = MetadataBuffers(
            AUX_SLOTS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        if role == "prefill":
            fill_meta(self.meta, 77)
        args = sg.KVArgs()
        args.engine_rank, args.system_dp_rank, args.pp_rank = rank, 0, 0
        args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
        args.page_size, args.gpu_id, args.ib_device = TOKENS, 0, ""
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.nbytes for t in self.kv]
        args.kv_item_lens = [kv.page_bytes(role)] * len(self.kv)
        args.kv_head_num, args.total_kv_head_num = h, kv.kv_heads
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        if shape.state == "swa":  # SGLang: append_state_component(SWA, pool's buf infos)
            args.state_types = [StateType.SWA]
            args.state_data_ptrs = [[t.data_ptr() for t in self.swa]]
            args.state_data_lens = [[t.nbytes for t in self.swa]]
            args.state_item_lens = [[swa_page] * len(self.swa)]
            args.swa_kv_cache_layout = "nhd"
        else:
            args.state_types = [StateType.MAMBA]
            args.state_data_ptrs = [[self.mamba.data_ptr()]]
            args.state_data_lens = [[self.mamba.nbytes]]
            args.state_item_lens = [[MAMBA_BYTES]]
        sa = server_args(role, kv.tp(role))
        sa.disaggregation_bootstrap_port, sa.port = kv.port, kv.port + 100
        mode = sg.Mode.PREFILL if role == "prefill" else sg.Mode.DECODE
        self.mgr = sg.cls("manager")(args, mode, sa, False)

    def state_indices(self) -> list[np.ndarray]:
        """What SGLang's ``_swa_payload`` / ``_mamba_payload`` hand send / send_metadata."""
        prefill = self.role == "prefill"
        if self.shape.state == "swa":
            return [SWA_SRC if prefill else SWA_DST[: 1 if self.shape.drift else None]]
        return [np.array([MAMBA_SRC if prefill else MAMBA_DST], np.int32)]

    def check(self) -> list[str]:
        """Every byte of this decode rank's pools: the room's KV and SWA pages hold this
        rank's heads of the prefill's, its Mamba slot the slot of the prefill rank of its
        own TP rank (equal TP), every other page and slot is zero (all of them, in a
        refused room)."""
        bad: list[str] = []
        name = f"{self.shape.name} decode {self.rank}"
        if self.shape.refused:  # no slot landed (nor KV pages, where refused before)
            pools = (*self.swa, self.mamba, *(() if self.shape.drift else self.kv))
            return [f"{name}: bytes in a refused room's pools" for t in pools if t.any()][:1]

        def compare(what: str, got: np.ndarray, dst: np.ndarray, want: np.ndarray) -> None:
            if not np.array_equal(got[dst], want):
                bad.append(f"{name} {what}: the room's pages differ")
            rest = np.setdiff1d(np.arange(got.shape[0]), dst)
            if got[rest].any():
                bad.append(f"{name} {what}: stray bytes outside the room")

        h = len(self.heads)
        for b, t in enumerate(self.kv):
            got = t.numpy().reshape(PAGES, TOKENS, h, DIM)
            compare(f"KV buffer {b}", got, DST, pattern(self.shape.kv, b, SRC, self.heads))
        swa_on = self.shape.state == "swa"
        for b, t in enumerate(self.swa):
            got = t.numpy().reshape(SWA_PAGES, TOKENS, h, SWA_DIM)
            want = swa_cube(b, SWA_SRC, self.heads) if swa_on else np.zeros_like(got[SWA_DST])
            compare(f"SWA buffer {b}", got, SWA_DST, want)
        got = self.mamba.numpy().reshape(MAMBA_SLOTS, MAMBA_BYTES)
        want = (
            mamba_item(self.rank, MAMBA_SRC)[None]
            if not swa_on
            else np.zeros((1, MAMBA_BYTES), np.uint8)
        )
        compare("Mamba slot", got, np.array([MAMBA_DST]), want)
        return bad


def run_rank(role: str, rank: int, url: str, out: str, names: list[str]) -> None:
    """Rank ``rank`` of ``role`` in every named shape: one room each to its conclusion
    (a decode rank checks its pools at the poll that reports Success), results to
    ``out``, then clear once the test has read the rooms (file ``clear``)."""
    os.environ["KVSTATE_REDIS_URL"] = url
    sg = sglang()
    KVPoll = sg.KVPoll
    sides = [
        StateSide(sg, s, role, rank) for s in SHAPES if s.name in names and rank < s.kv.tp(role)
    ]
    parts: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for side in sides:
        kv = side.shape.kv
        if role == "decode":
            while not side.mgr.try_ensure_parallel_info(kv.addr):
                time.sleep(0.05)
        cls = sg.cls("sender" if role == "prefill" else "receiver")
        part = cls(side.mgr, kv.addr, kv.room(0))
        if role == "decode":
            part.init(0)
        parts[side.shape.name] = part
    by_name = {side.shape.name: side for side in sides}
    acted: set[str] = set()
    done: dict[str, int] = {}
    deadline = time.monotonic() + 180
    while len(done) < len(parts) and time.monotonic() < deadline:
        for name, part in parts.items():
            if name in done:
                continue
            side = by_name[name]
            st = part.poll()
            if st in (KVPoll.Success, KVPoll.Failed):
                done[name] = int(st)
                if role == "decode":  # the pools at the step the outcome is reported
                    result[f"{name}:mismatch"] = side.check()
                continue
            if name in acted or st != KVPoll.WaitingForInput:
                continue
            if role == "decode":
                part.send_metadata(DST, AUX_SLOTS - 1, side.state_indices(), 0)
            else:
                part.init(len(SRC), 1)
                part.send(SRC[:2])
                part.send(SRC[2:], side.state_indices(), num_kv_tokens=len(SRC[2:]) * TOKENS)
            acted.add(name)
        time.sleep(0.01)
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    expected_meta = MetadataBuffers(
        AUX_SLOTS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
    )
    fill_meta(expected_meta, 77)
    for name, part in parts.items():
        result[name] = done.get(name, -1)
        if done.get(name) == int(KVPoll.Failed):
            try:
                part.failure_exception()
            except Exception as exc:  # SGLang's KVTransferError, with the reason
                result[f"{name}:error"] = f"{type(exc).__name__}: {exc}"
        if role == "decode":
            result[f"{name}:aux"] = slot(by_name[name].meta, AUX_SLOTS - 1) == slot(
                expected_meta, 1
            )
        else:
            result[f"{name}:bytes"] = part.get_transfer_metric().transfer_total_bytes
    report_then_clear(out, f"{role}{rank}", result, parts.values(), sides, deadline)
