"""Engine ranks of two TP groups of different sizes, one spawned process each, for
tests/test_tp.py: every rank registers its own KV pool with kvstate's UCX transport
(named layers, heads per page), and the rooms' pages move between them as
``kvstate.tp`` routes them. A prefill pool holds, for every (layer, page, token, global
head), bytes derived from those numbers, so a decode rank knows what each of its pages
must hold once it reads Success, and checks every byte itself.

Module-level functions so that ``spawn`` can import them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import numpy as np

import kvstate
from kvstate import KVPoll
from kvstate.tp import local_heads, receivers_per_sender, routes
from tests.helpers import scaled

ADDR = "10.9.9.9:8998"
LAYERS, PAGES, TOKENS, DIM = 2, 64, 4, 8  # DIM bytes of one head of one token


@dataclass(frozen=True)
class Shape:
    """Both groups: TP sizes, the model's KV heads, MLA (one latent, whole pages), and
    whether heads are outermost in a page ([heads, tokens, dim]) or inner ([tokens,
    heads, dim])."""

    prefill_tp: int
    decode_tp: int
    kv_heads: int
    mla: bool = False
    heads_outer: bool = True

    def heads(self, tp: int) -> int:
        return 1 if self.mla else local_heads(tp, self.kv_heads)

    def first(self, rank: int, tp: int) -> int:
        return 0 if self.mla else rank * self.kv_heads // tp


def page_of(shape: Shape, layer: int, page: int, global_heads: list[int]) -> np.ndarray:
    """The bytes of one page holding ``global_heads``, as a prefill rank fills it."""
    tok = np.arange(TOKENS)[:, None, None]
    head = np.asarray(global_heads)[None, :, None]
    dim = np.arange(DIM)[None, None, :]
    cube = (layer * 97 + page * 31 + tok * 7 + head * 13 + dim) % 251  # [tokens, heads, dim]
    if shape.heads_outer:
        cube = cube.transpose(1, 0, 2)
    return cube.astype(np.uint8).reshape(-1)


def pool(shape: Shape, rank: int, tp: int, filled: bool) -> list[np.ndarray]:
    h = shape.heads(tp)
    page_bytes = TOKENS * h * DIM
    if not filled:
        return [np.zeros(PAGES * page_bytes, dtype=np.uint8) for _ in range(LAYERS)]
    heads = [shape.first(rank, tp) + k for k in range(h)]
    return [
        np.concatenate([page_of(shape, layer, p, heads) for p in range(PAGES)])
        for layer in range(LAYERS)
    ]


def _transport(shape: Shape, rank: int, tp: int, filled: bool) -> tuple[object, list[np.ndarray]]:
    from transports.base import Geometry
    from transports.ucx import UCXTransport

    h = shape.heads(tp)
    bufs = pool(shape, rank, tp, filled)
    outer = 1 if shape.heads_outer else TOKENS
    geometry = [Geometry(f"layer.{i}", 0 if shape.mla else h, outer) for i in range(LAYERS)]
    t = UCXTransport()
    t.register_buffers(bufs, [TOKENS * h * DIM] * LAYERS, geometry)
    return t, bufs


def prefill_rank(
    url: str, ns: str, shape: Shape, rank: int, rooms: dict[int, list[int]], results: Queue
) -> None:
    """One prefill rank: a sender per room that waits for as many receivers as they
    declare, sends the room's pages, and reports each room's outcome."""
    transport, _ = _transport(shape, rank, shape.prefill_tp, filled=True)
    store = kvstate.connect(url, namespace=ns)
    name = f"pf.tp{rank}"
    with kvstate.KVManager(
        store, "prefill", name, ADDR, transport, ranks=shape.prefill_tp, transfer_timeout=20.0
    ) as mgr:  # type: ignore[arg-type]
        results.put(("ready", name))
        senders = {room: mgr.sender(room, required_receivers=None) for room in rooms}
        out = {}
        deadline = time.monotonic() + scaled(60)
        for room, snd in senders.items():
            while snd.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
                time.sleep(0.01)
            if snd.status == KVPoll.WaitingForInput:
                snd.send(np.asarray(rooms[room]), last=True)
            out[room] = (snd.poll().name, snd.reason, sorted(snd.published))
            snd.clear()
        moved = transport.stats.bytes_moved  # type: ignore[attr-defined]
        results.put(("prefill", name, out, moved))
    transport.close()  # type: ignore[attr-defined]


def decode_rank(
    url: str,
    ns: str,
    shape: Shape,
    rank: int,
    rooms: dict[int, tuple[list[int], list[int]]],
    results: Queue,
    abort_room: int | None = None,
    aborted: Event | None = None,
) -> None:
    """One decode rank: a receiver per room routed to the prefill ranks that hold its
    heads (and its dummies), waits for the room to end, and checks every byte. With
    ``abort_room``, rank 0 aborts that room before publishing; the other ranks publish it
    only once ``aborted`` is set (after the abort), so no rank can finish it first."""
    transport, bufs = _transport(shape, rank, shape.decode_tp, filled=False)
    store = kvstate.connect(url, namespace=ns)
    name = f"dc.tp{rank}"
    table = routes(shape.prefill_tp, shape.decode_tp, shape.kv_heads, rank, mla=shape.mla)
    per_sender = receivers_per_sender(
        shape.prefill_tp, shape.decode_tp, shape.kv_heads, mla=shape.mla
    )
    with kvstate.KVManager(store, "decode", name, transport=transport) as mgr:  # type: ignore[arg-type]
        receivers = {}
        for room, (_, dst) in rooms.items():
            rcv = mgr.receiver(
                room,
                ADDR,
                senders={f"pf.tp{p}": r for p, r in table.items()},
                receivers_per_sender=per_sender,
            )
            if room == abort_room and rank == 0:
                rcv.abort("decode rank gave up")
            else:
                if room == abort_room and aborted is not None:
                    aborted.wait(scaled(60))
                rcv.init(np.asarray(dst))
            receivers[room] = rcv
        out = {}
        deadline = time.monotonic() + scaled(60)
        for room, rcv in receivers.items():
            while rcv.poll() not in (KVPoll.Success, KVPoll.Failed):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            bad = checked = 0
            if rcv.status == KVPoll.Success:
                bad, checked = _check(shape, rank, bufs, *rooms[room])
            out[room] = (rcv.status.name, rcv.reason, bad, checked)
            rcv.clear()
        results.put(("decode", name, out, sorted(table)))
    transport.close()  # type: ignore[attr-defined]


def _check(
    shape: Shape, rank: int, bufs: list[np.ndarray], src: list[int], dst: list[int]
) -> tuple[int, int]:
    """(pages that differ, bytes checked): each destination page must hold the source
    page's bytes of this rank's heads."""
    h = shape.heads(shape.decode_tp)
    heads = [shape.first(rank, shape.decode_tp) + k for k in range(h)]
    page_bytes = TOKENS * h * DIM
    bad = checked = 0
    for layer, buf in enumerate(bufs):
        pages = buf.reshape(PAGES, page_bytes)
        for s, d in zip(src, dst, strict=True):
            want = page_of(shape, layer, s, heads)
            bad += int(not np.array_equal(pages[d], want))
            checked += want.size
    return bad, checked
