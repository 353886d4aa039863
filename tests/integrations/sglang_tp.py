"""SGLang ranks of attention TP groups of different sizes, for test_sglang_across_tp.py.
SGLang's CPU engine cannot run TP > 1 (its TP group builds a PyNcclCommunicator), so each rank is
what SGLang's scheduler builds for it: KVArgs (kv_data_ptrs, kv_head_num,
total_kv_head_num, page_size, MetadataBuffers' aux buffers), ServerArgs, and the
backend's manager/sender/receiver classes from SGLang's own ``get_kv_class``, one
process per rank over real Redis and UCX/CMA.

A process is "prefill rank k" (or "decode rank k") of every shape whose group has a rank
k: one manager per shape, each shape on its own bootstrap address, so ranks of one shape
are always separate processes. A prefill rank's pool holds, for every (buffer, page,
token, global head, byte), a value derived from those numbers; a prefill rank no decode
rank reads from (a dummy) holds 0xEE instead, so a write it should not make shows. A
decode rank checks every byte of its pool once its room reports Success: the pages it
received against the pattern of its own heads, every other page still zero.

Module-level functions so that ``spawn`` can import them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstate.tp import local_heads, routes
from tests.integrations.rig import HOST, sglang

PAGES, TOKENS, DIM, LAYERS = 16, 4, 8, 2  # DIM bytes per head per token; K and V per layer
AUX_SLOTS = 4
SRC = np.array([3, 7, 8, 9, 12], np.int32)  # the ok room's pages, sent in two chunks
DST = np.array([14, 0, 5, 6, 2], np.int32)  # where each lands on every decode rank
OK, ABORT = 0, 1  # room offsets: one that moves, one a decode rank aborts
GARBAGE = 0xEE


@dataclass(frozen=True)
class Shape:
    """One pair of TP groups: sizes, the model's KV heads, MLA, its bootstrap port."""

    name: str
    prefill_tp: int
    decode_tp: int
    kv_heads: int
    mla: bool
    port: int
    pp: int = 1  # the prefill's pipeline stages
    dp: int = 1  # the prefill's DP ranks (DP attention: attention TP prefill_tp each)

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def ranks(self, role: str) -> int:
        """Processes of a side: TP x PP ranks (process i: TP rank i // pp, stage i % pp)."""
        return self.prefill_tp * self.pp * self.dp if role == "prefill" else self.decode_tp

    def layers(self, role: str, index: int) -> list[int]:
        """The layers a rank's pool holds: a prefill stage's share, else all."""
        if role == "decode" or self.pp == 1:
            return list(range(LAYERS))
        per = LAYERS // self.pp
        stage = index % self.pp
        return list(range(stage * per, stage * per + per))

    def heads(self, role: str) -> int:
        return 1 if self.mla else local_heads(self.tp(role), self.kv_heads)

    def first(self, role: str, rank: int) -> int:
        tp = self.tp(role)
        return 0 if self.mla else rank * self.kv_heads // tp

    def buffers(self, layers: list[int]) -> list[int]:
        """The global buffer index (the decode's position) of each buffer of a pool
        holding ``layers``: every K, then every V (MHA), or one latent each (MLA)."""
        return list(layers) if self.mla else [*layers, *(LAYERS + i for i in layers)]

    def page_bytes(self, role: str) -> int:
        return TOKENS * self.heads(role) * DIM

    def read(self) -> set[int]:
        """Prefill ranks some decode rank reads KV from (the others are dummies)."""
        return {
            p
            for d in range(self.decode_tp)
            for p, r in routes(
                self.prefill_tp, self.decode_tp, self.kv_heads, d, mla=self.mla
            ).items()
            if not r.dummy
        }

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def room(self, k: int) -> int:
        return self.port * 10 + k


SHAPES = [
    Shape("1->2", 1, 2, 2, False, 19101),  # each decode rank one of the two heads
    Shape("1->4", 1, 4, 2, False, 19102),  # GQA: each head on two decode ranks
    Shape("2->1", 2, 1, 2, False, 19103),  # the decode gathers a head from each rank
    Shape("4->1", 4, 1, 2, False, 19104),  # GQA: two prefill ranks per head, two dummies
    Shape("MLA 1->2", 1, 2, 1, True, 19105),  # both decode ranks read the one latent
    Shape("MLA 2->1", 2, 1, 1, True, 19106),  # one prefill rank sends, one is a dummy
    Shape("PP2 1->1", 1, 1, 2, False, 19107, pp=2),  # each stage its layer
    Shape("TP2xPP2 -> 1", 2, 1, 2, False, 19108, pp=2),  # 4 ranks, a head and layer each
    # DP attention: 2 DP ranks of TP 1; the decode picks bootstrap_room % 2 (SGLang's
    # own resolution): the ok room from DP rank 0, the aborted one from DP rank 1
    Shape("DP2 1->1", 1, 1, 2, False, 19109, dp=2),
]


def pattern(shape: Shape, buf: int, pages: np.ndarray, heads: list[int]) -> np.ndarray:
    """Bytes of ``pages`` of buffer ``buf`` holding ``heads``: [page, token, head, dim]."""
    page = pages.astype(np.int64)[:, None, None, None]
    tok = np.arange(TOKENS)[None, :, None, None]
    head = np.asarray(heads)[None, None, :, None]
    dim = np.arange(DIM)[None, None, None, :]
    return ((buf * 97 + page * 31 + tok * 7 + head * 13 + dim) % 251).astype(np.uint8)


def fill_meta(meta: Any, seed: int) -> None:
    """Every prefill rank's metadata buffers hold the same bytes (one request's output)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for t in meta_tensors(meta):
        v = t.view(torch.uint8).view(-1)
        v.copy_(torch.randint(0, 256, (v.numel(),), dtype=torch.uint8, generator=gen))


def meta_tensors(meta: Any) -> list[Any]:
    ptrs = meta.get_buf_infos()[0]
    found = [getattr(meta, n, None) for n in dir(meta)]
    out = [t for t in found if hasattr(t, "data_ptr") and t.data_ptr() in ptrs]
    return sorted(out, key=lambda t: ptrs.index(t.data_ptr()))


def slot(meta: Any, i: int) -> bytes:
    import torch

    return b"".join(
        t[i : i + 1].contiguous().view(torch.uint8).numpy().tobytes() for t in meta_tensors(meta)
    )


class Side:
    """One rank of one shape: its KV pool, metadata buffers and SGLang manager."""

    def __init__(self, sg: Any, shape: Shape, role: str, index: int) -> None:
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        from tests.integrations.rig import server_args

        pp = shape.pp if role == "prefill" else 1
        self.dp_rank, rest = (
            divmod(index, shape.prefill_tp * pp) if role == "prefill" else (0, index)
        )
        rank, stage = divmod(rest, pp)
        self.shape, self.role, self.rank = shape, role, index
        h = shape.heads(role)
        self.heads = [shape.first(role, rank) + k for k in range(h)]
        n = PAGES * shape.page_bytes(role)
        layers = shape.layers(role, rest)
        self.global_buffers = shape.buffers(layers)
        self.kv = [torch.zeros(n, dtype=torch.uint8) for _ in self.global_buffers]
        if role == "prefill":
            for b, t in zip(self.global_buffers, self.kv, strict=True):
                if rank in shape.read() and shape.room(OK) % shape.dp == self.dp_rank:
                    cube = pattern(shape, b, np.arange(PAGES), self.heads)
                    t.copy_(torch.from_numpy(cube.reshape(-1)))
                else:
                    t.fill_(GARBAGE)
        self.meta = MetadataBuffers(
            AUX_SLOTS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        if role == "prefill":  # the metadata is the last stage's output
            fill_meta(self.meta, 77 if stage == pp - 1 else 78)
        args = sg.KVArgs()
        args.engine_rank = self.dp_rank * shape.tp(role) + rank
        args.system_dp_rank = self.dp_rank
        args.pp_rank = stage
        args.prefill_start_layer = layers[0]
        args.prefill_end_layer = layers[-1] + 1
        args.page_size = TOKENS
        args.gpu_id = 0
        args.ib_device = ""
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.nbytes for t in self.kv]
        args.kv_item_lens = [shape.page_bytes(role)] * len(self.kv)
        if not shape.mla:  # what SGLang's prefill.py / decode.py set for MHA pools
            args.kv_head_num = h
            args.total_kv_head_num = shape.kv_heads
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types = []
        args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
        sa = server_args(role, shape.tp(role))
        sa.disaggregation_bootstrap_port = shape.port
        sa.port = shape.port + 100
        sa.pp_size = pp
        if role == "prefill" and shape.dp > 1:
            sa.dp_size, sa.enable_dp_attention = shape.dp, True
            sa.tp_size = shape.prefill_tp * shape.dp
        mode = sg.Mode.PREFILL if role == "prefill" else sg.Mode.DECODE
        self.mgr = sg.cls("manager")(args, mode, sa, shape.mla)

    def check(self) -> list[str]:
        """Every byte of this decode rank's pool: the room's pages hold this rank's heads
        of the prefill's pages, every other page is still zero."""
        bad = []
        untouched = np.setdiff1d(np.arange(PAGES), DST)
        for b, t in zip(self.global_buffers, self.kv, strict=True):
            got = t.numpy().reshape(PAGES, TOKENS, len(self.heads), DIM)
            if not np.array_equal(got[DST], pattern(self.shape, b, SRC, self.heads)):
                bad.append(f"{self.shape.name} decode {self.rank} buffer {b}: pages differ")
            if got[untouched].any():
                bad.append(f"{self.shape.name} decode {self.rank} buffer {b}: stray bytes")
        return bad


def prefill_dp_rank(mgr: Any, shape: Shape, room: int) -> int:
    """The prefill DP rank SGLang's decode queue picks for a request (its own code)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    req = SimpleNamespace(
        bootstrap_host=HOST,
        bootstrap_port=shape.port,
        bootstrap_room=room,
        disagg_prefill_dp_rank=None,
    )
    rank = DecodePreallocQueue._resolve_prefill_dp_rank(SimpleNamespace(kv_manager=mgr), req)
    assert rank is not None, "SGLang could not resolve the prefill DP rank"
    return int(rank)


def run_rank(role: str, rank: int, url: str, out: str, names: list[str]) -> None:
    """Every shape's rank ``rank`` of ``role``: both rooms to a conclusion, results to
    ``out``, then clear once the test has read the rooms (file ``clear``)."""
    os.environ["KVSTATE_REDIS_URL"] = url
    sg = sglang()
    KVPoll = sg.KVPoll
    sides = [Side(sg, s, role, rank) for s in SHAPES if s.name in names and rank < s.ranks(role)]
    Path(out, f"{role}{rank}.up").write_text("1")
    parts: dict[tuple[str, int], Any] = {}
    result: dict[str, Any] = {}
    for side in sides:
        s = side.shape
        if role == "decode":
            while not side.mgr.try_ensure_parallel_info(s.addr):
                time.sleep(0.05)
            info = side.mgr.prefill_info_table[s.addr]
            result[f"{s.name}:info_tp"] = info.tp_size
            result[f"{s.name}:info_dp"] = info.dp_size
        for k in (OK, ABORT):
            if role == "prefill" and s.room(k) % s.dp != side.dp_rank:
                continue  # SGLang hands a request to one DP rank of the prefill
            cls = sg.cls("sender" if role == "prefill" else "receiver")
            part = cls(side.mgr, s.addr, s.room(k))
            if role == "decode":
                part.init(prefill_dp_rank(side.mgr, s, s.room(k)))
            parts[(s.name, k)] = part
    by_name = {side.shape.name: side for side in sides}
    acted: set[tuple[str, int]] = set()
    done: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}  # a room that never concluded: where it stopped
    deadline = time.monotonic() + 180
    while len(done) < len(parts) and time.monotonic() < deadline:
        for key, part in parts.items():
            if key in done:
                continue
            st = part.poll()
            last[key] = int(st)
            if st in (KVPoll.Success, KVPoll.Failed):
                done[key] = int(st)
                continue
            if key in acted:
                continue
            name, k = key
            if role == "decode" and st == KVPoll.WaitingForInput:
                part.send_metadata(DST, AUX_SLOTS - 1, None, 0)
                acted.add(key)
                if k == ABORT and rank == by_name[name].shape.decode_tp - 1:
                    part.abort()  # one decode rank: every rank of the room fails
            elif role == "prefill" and st == KVPoll.WaitingForInput and k == OK:
                part.init(len(SRC), 1)
                part.send(SRC[:2])
                part.send(SRC[2:])
                acted.add(key)
        time.sleep(0.01)
    for (name, k), part in parts.items():
        tag = f"{name}:{'ok' if k == OK else 'abort'}"
        result[tag] = done.get((name, k), -1 - last.get((name, k), 0))
        if done.get((name, k)) == int(KVPoll.Failed):
            try:
                part.failure_exception()
            except Exception as exc:  # SGLang's KVTransferError, with the reason
                result[tag + ":error"] = f"{type(exc).__name__}: {exc}"
        if role == "prefill" and k == OK:
            result[tag + ":bytes"] = part.get_transfer_metric().transfer_total_bytes
    if role == "decode":
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        # the metadata every prefill rank wrote
        expected_meta = MetadataBuffers(
            AUX_SLOTS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        fill_meta(expected_meta, 77)
        for side in sides:
            name = side.shape.name
            result[f"{name}:mismatch"] = side.check()
            result[f"{name}:aux"] = slot(side.meta, AUX_SLOTS - 1) == slot(expected_meta, 1)
            result[f"{name}:compared"] = sum(t.nbytes for t in side.kv)
    report_then_clear(out, f"{role}{rank}", result, parts.values(), sides, deadline)
    Path(out, f"{role}{rank}.closed").write_text("1")


def report_then_clear(
    out: str, rank: str, result: dict[str, Any], parts: Any, sides: Any, deadline: float
) -> None:
    """Write a rank's results, hold its rooms until the test says ``clear`` (it reads
    them meanwhile), then clear them and close the rank's managers."""
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    clear = Path(out, "clear")
    while not clear.exists() and time.monotonic() < deadline + 60:
        time.sleep(0.05)
    for part in parts:
        part.clear()
    for side in sides:
        side.mgr.close()
