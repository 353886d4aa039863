"""Heterogeneous tensor parallelism (issue 29): a room with N prefill ranks and M decode
ranks, each decode rank routed to exactly the prefill ranks that hold its heads
(``kvstate.tp``), every sender waiting for as many receivers as they declare, one
outcome for the whole room; the pages move between real processes over kvstate's UCX
transport, and every byte is compared."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

import kvstate
from kvstate import KVPoll
from kvstate.errors import InvalidValueError
from kvstate.store import Store, command_call
from kvstate.tp import Route, local_heads, receivers_per_sender, routes
from tests import tp_ranks
from tests.helpers import keys_of, scaled, wait_for
from tests.tp_ranks import Shape
from transports.base import Heads

NAMESPACE = "tp"
CHECK_TTL = True


# -- the table --------------------------------------------------------------------------
def _global(tp: int, heads: int, rank: int, k: int) -> int:
    return rank * heads // tp + (k if heads >= tp else 0)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "kv_heads", "mla"),
    [
        (p, d, h, m)
        for p, d, h, m in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8, 16], [0, 1])
        if max(p, d) % min(p, d) == 0
    ],
)
def test_every_decode_head_is_read_once_from_a_rank_that_holds_it(
    prefill_tp: int, decode_tp: int, kv_heads: int, mla: int
) -> None:
    heads = 1 if mla else kv_heads
    counts = [0] * prefill_tp
    for d in range(decode_tp):
        table = routes(prefill_tp, decode_tp, kv_heads, d, mla=bool(mla))
        got: dict[int, int] = {}
        for p, r in table.items():
            counts[p] += 1
            if r.dummy:
                continue
            if r.heads is None:  # whole pages: one latent everywhere
                assert mla and len(table) - sum(x.dummy for x in table.values()) == 1
                got[0] = 0
                continue
            for k in range(r.heads.count):
                assert r.heads.dst + k not in got
                got[r.heads.dst + k] = _global(prefill_tp, heads, p, r.heads.src + k)
        mine = local_heads(decode_tp, heads)
        assert got == {k: _global(decode_tp, heads, d, k) for k in range(mine)}
    assert set(counts) == {receivers_per_sender(prefill_tp, decode_tp, kv_heads, mla=bool(mla))}


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(InvalidValueError, match="one must divide the other"):
        routes(2, 3, 6, 0)
    with pytest.raises(InvalidValueError, match="3 KV heads over TP 2"):
        routes(2, 2, 3, 0)
    assert routes(4, 1, 2, 0) == {
        0: Route(Heads(0, 0, 1)),
        1: Route(dummy=True),
        2: Route(Heads(0, 1, 1)),
        3: Route(dummy=True),
    }


# -- the state core, one process --------------------------------------------------------
def _room(store: Store, prefill_tp: int, decode_tp: int, heads: int, senders_first: bool) -> Any:
    pm = [
        kvstate.KVManager(store, "prefill", f"p.tp{i}", "pa:1", ranks=prefill_tp)
        for i in range(prefill_tp)
    ]
    dm = [kvstate.KVManager(store, "decode", f"d.tp{i}", f"da:{i}") for i in range(decode_tp)]
    per = receivers_per_sender(prefill_tp, decode_tp, heads)
    snds = [m.sender(7, required_receivers=None) for m in pm] if senders_first else []
    for s in snds:
        assert s.poll() == KVPoll.Bootstrapping
    rcvs = []
    for d, m in enumerate(dm):
        table = {f"p.tp{p}": r for p, r in routes(prefill_tp, decode_tp, heads, d).items()}
        rcv = m.receiver(7, "pa:1", senders=table, receivers_per_sender=per)
        assert rcv.init([d, d + 1]) in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
        rcvs.append(rcv)
    if not senders_first:
        snds = [m.sender(7, required_receivers=None) for m in pm]
    return pm, dm, snds, rcvs


@pytest.mark.parametrize("senders_first", [True, False], ids=["senders-first", "receivers-first"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (4, 2)])
def test_a_sender_waits_for_as_many_receivers_as_they_declare(
    store: Store, prefill_tp: int, decode_tp: int, senders_first: bool
) -> None:
    """Every sender becomes WaitingForInput once all its receivers published, whether
    they published before it existed (it learns the count from their infos) or after
    (their first info writes it); then the room ends in Success on every rank."""
    pm, dm, snds, rcvs = _room(store, prefill_tp, decode_tp, 4, senders_first)
    try:
        for _ in range(3):
            polled = [s.poll() for s in snds]
        assert polled == [KVPoll.WaitingForInput] * prefill_tp
        per = receivers_per_sender(prefill_tp, decode_tp, 4)
        assert [len(s.published) for s in snds] == [per] * prefill_tp
        for s in snds:
            assert s.begin_transfer() == KVPoll.Transferring
            assert s.finish_transfer() == KVPoll.Success
        assert [r.poll() for r in rcvs] == [KVPoll.Success] * decode_tp
        for p in snds + rcvs:
            p.clear()
        assert keys_of(store, store.keys.all_pattern.replace("*", "{7}*")) == []
    finally:
        for m in pm + dm:
            m.close()


def test_a_sender_with_its_own_count_refuses_receivers_that_declare_another(
    store: Store,
) -> None:
    """A prefill rank that expects one receiver, and decode ranks that say each sender
    serves two: the layouts disagree, so the room fails with the reason instead of the
    sender finishing after the first of them."""
    with (
        kvstate.KVManager(store, "prefill", "p.tp0", "pa:1") as p,
        kvstate.KVManager(store, "decode", "d.tp0", "da:0") as d,
    ):
        snd = p.sender(8, required_receivers=1)
        assert snd.poll() == KVPoll.Bootstrapping
        table = {"p.tp0": routes(1, 2, 4, 0)[0]}
        rcv = d.receiver(8, "pa:1", senders=table, receivers_per_sender=2)
        assert rcv.init([1]) == KVPoll.Failed
        assert "declares 2 receivers for sender p.tp0, which serves 1" in rcv.reason
        assert snd.poll() == KVPoll.Failed and "declares 2 receivers" in snd.reason
        snd.clear()
        rcv.clear()


# -- real processes, real bytes ---------------------------------------------------------
SHAPES = {
    "tp1-tp2": Shape(1, 2, 4),
    "tp1-tp4-gqa2-nhd": Shape(1, 4, 2, heads_outer=False),
    "tp2-tp1": Shape(2, 1, 4),
    "tp4-tp1-gqa2": Shape(4, 1, 2),
    "tp2-tp4-mla": Shape(2, 4, 1, mla=True),
    "tp4-tp2-mla": Shape(4, 2, 1, mla=True),
}


def _run(
    spawn_ctx: Any, url: str, shape: Shape, abort_room: int | None = None, seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rooms = {}
    dst_pages = rng.choice(tp_ranks.PAGES, 24, replace=False).tolist()  # no two rooms share one
    for i, room in enumerate((101, 102)):
        src = rng.choice(tp_ranks.PAGES, 12, replace=False).tolist()
        rooms[room] = (src, dst_pages[12 * i : 12 * i + 12])
    results = spawn_ctx.Queue()
    aborted = spawn_ctx.Event()
    starts = [("prefill", p) for p in range(shape.prefill_tp)]
    starts += [("decode", d) for d in range(shape.decode_tp)]
    random.Random(seed).shuffle(starts)  # ranks come up in any order
    procs = []
    for side, rank in starts:
        if side == "prefill":
            src_rooms = {r: src for r, (src, _) in rooms.items()}
            args = (url, NAMESPACE, shape, rank, src_rooms, results)
            target: Any = tp_ranks.prefill_rank
        else:
            args = (url, NAMESPACE, shape, rank, rooms, results, abort_room, aborted)  # type: ignore[assignment]
            target = tp_ranks.decode_rank
        proc = spawn_ctx.Process(target=target, args=args)
        proc.start()
        procs.append(proc)
    if abort_room is not None:  # the other decode ranks publish only after the abort
        store = kvstate.connect(url, namespace=NAMESPACE)
        mark = store.keys.aborted(abort_room)
        assert wait_for(lambda: store.execute([command_call("EXISTS", mark)]) == [1], 60)
        store.close()
        aborted.set()
    got = [results.get(timeout=scaled(180)) for _ in range(len(procs) + shape.prefill_tp)]
    for proc in procs:
        proc.join(scaled(30))
        assert proc.exitcode == 0
    prefill = {g[1]: g[2] for g in got if g[0] == "prefill"}
    decode = {g[1]: (g[2], g[3]) for g in got if g[0] == "decode"}
    moved = sum(g[3] for g in got if g[0] == "prefill")
    if abort_room is None:  # every byte a decode rank holds came once, from one rank
        assert moved == sum(o[3] for out, _ in decode.values() for o in out.values())
    return prefill, decode


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_kv_heads_move_byte_exact_between_groups_of_different_tp(
    spawn_ctx: Any, redis_url: str, name: str
) -> None:
    shape = SHAPES[name]
    prefill, decode = _run(spawn_ctx, redis_url, shape, seed=sum(map(ord, name)))
    assert len(prefill) == shape.prefill_tp and len(decode) == shape.decode_tp
    for ranks_out in prefill.values():
        for status, reason, _ in ranks_out.values():
            assert status == "Success", reason
    for out, _ in decode.values():
        for status, reason, bad, checked in out.values():
            assert status == "Success", reason
            assert bad == 0 and checked > 0
    _no_keys_left(redis_url)


def test_one_decode_rank_aborting_fails_the_room_on_every_rank(
    spawn_ctx: Any, redis_url: str
) -> None:
    """TP 2 -> TP 4: decode rank 0 gives up on room 101 before publishing its pages;
    every prefill and decode rank reads it Failed with that reason, and room 102 still
    succeeds everywhere."""
    prefill, decode = _run(spawn_ctx, redis_url, Shape(2, 4, 4), abort_room=101, seed=5)
    for ranks_out in prefill.values():
        assert ranks_out[101][0] == "Failed" and "decode rank gave up" in ranks_out[101][1]
        assert ranks_out[102][0] == "Success"
    for out, _ in decode.values():
        assert out[101][0] == "Failed" and "decode rank gave up" in out[101][1]
        assert out[102][0] == "Success" and out[102][2] == 0
    _no_keys_left(redis_url)


def _no_keys_left(url: str) -> None:
    store = kvstate.connect(url, namespace=NAMESPACE)
    try:
        assert keys_of(store) == []
    finally:
        store.close()
