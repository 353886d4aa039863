"""Parts of pages and named buffers over the UCX transport, between real processes:
a sender writes some KV heads of each page into other heads of the receiver's pages
(tensor parallelism of different sizes on the two sides), or its layers into the
receiver's buffers of the same names (a pipeline stage), by CMA on one host and by UCX
puts (CMA off), every byte compared; layouts that do not fit are refused before any
byte moves."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.transport_rig import FILL, Peer, sender_pages
from transports.base import Geometry, Heads

PAGES = 24
CHUNK = 32  # bytes of one head in one block
PATHS = {"cma": {}, "ucx": {"KVSTATE_UCX_CMA": "0"}}


@pytest.fixture(params=sorted(PATHS))
def env(request: pytest.FixtureRequest) -> dict[str, str]:
    return PATHS[request.param]


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for p in made:
        p.stop()


def spec_of(heads: int, outer: int, layers: int = 2) -> list[tuple[int, int]]:
    return [(PAGES, outer * heads * CHUNK)] * layers


def geometry(heads: int, outer: int, names: list[str]) -> list[Geometry]:
    return [Geometry(n, heads, outer) for n in names]


def blocks(page: np.ndarray, outer: int, heads: int) -> np.ndarray:
    return page.reshape(outer, heads, CHUNK)


@pytest.mark.parametrize("outer", [1, 4], ids=["heads-outer", "heads-inner"])
def test_one_prefill_rank_feeds_two_decode_ranks_half_the_heads_each(
    env: dict[str, str], peers: list[Peer], outer: int
) -> None:
    """TP 1 -> TP 2: the sender's heads 0-1 go to rank 0's heads 0-1, 2-3 to rank 1's."""
    names = ["l0", "l1"]
    tx = Peer("sender", spec_of(4, outer), env, geometry(4, outer, names))
    rxs = [Peer("receiver", spec_of(2, outer), env, geometry(2, outer, names)) for _ in range(2)]
    peers += [tx, *rxs]
    src, dst = np.arange(3, 11), np.array([20, 2, 3, 4, 9, 10, 11, 0])
    targets = [r.target(dst, heads=Heads(2 * i, 0, 2)) for i, r in enumerate(rxs)]
    tx.call("write", 1, src, targets, 30.0)
    for i, rx in enumerate(rxs):
        for layer, got in enumerate(rx.layers()):
            want = np.full_like(got, FILL)
            sent = sender_pages(layer, spec_of(4, outer))
            for s, d in zip(src, dst, strict=True):
                blocks(want[d], outer, 2)[:] = blocks(sent[s], outer, 4)[:, 2 * i : 2 * i + 2]
            assert np.array_equal(got, want), (i, layer)


def test_two_prefill_ranks_fill_one_decode_rank_and_nothing_else(
    env: dict[str, str], peers: list[Peer]
) -> None:
    """TP 2 -> TP 1 (heads innermost, 4 tokens a page): each sender's 2 heads into its
    place among the receiver's 4; pages the room does not name stay as they were."""
    outer, names = 4, ["l0", "l1"]
    txs = [
        Peer("sender", spec_of(2, outer), env, geometry(2, outer, names), seed) for seed in (7, 8)
    ]
    rx = Peer("receiver", spec_of(4, outer), env, geometry(4, outer, names))
    peers += [*txs, rx]
    src, dst = np.array([0, 1, 2, 7]), np.array([5, 6, 7, 1])
    for i, tx in enumerate(txs):
        tx.call("write", 2, src, [rx.target(dst, heads=Heads(0, 2 * i, 2))], 30.0)
    for layer, got in enumerate(rx.layers()):
        want = np.full_like(got, FILL)
        for i, seed in enumerate((7, 8)):
            sent = sender_pages(layer, spec_of(2, outer), seed)
            for s, d in zip(src, dst, strict=True):
                blocks(want[d], outer, 4)[:, 2 * i : 2 * i + 2] = blocks(sent[s], outer, 2)
        assert np.array_equal(got, want), layer


def test_a_pipeline_stage_writes_its_layers_into_the_buffers_of_their_names(
    env: dict[str, str], peers: list[Peer]
) -> None:
    """A stage holding layers 2 and 3 writes them into a receiver holding 0-3 (matched
    by name); ``buffers`` narrows a write to some of them."""
    tx = Peer("sender", spec_of(2, 1), env, geometry(2, 1, ["l2", "l3"]))
    rx = Peer("receiver", spec_of(2, 1, 4), env, geometry(2, 1, ["l0", "l1", "l2", "l3"]))
    peers += [tx, rx]
    tx.call("write", 3, np.arange(4), [rx.target(np.arange(10, 14))], 30.0)
    tx.call("write", 3, np.array([5]), [rx.target(np.array([0]), buffers=("l3",))], 30.0)
    got = rx.layers()
    for layer in (0, 1):
        assert (got[layer] == FILL).all(), f"layer {layer} was written"
    for layer, local in ((2, 0), (3, 1)):
        sent = sender_pages(local, spec_of(2, 1))
        assert np.array_equal(got[layer][10:14], sent[0:4])
        assert (got[layer][14:] == FILL).all()
    assert np.array_equal(got[3][0], sender_pages(1, spec_of(2, 1))[5])
    assert (got[2][0] == FILL).all()


@pytest.mark.parametrize(
    ("rx_heads", "rx_outer", "heads", "message"),
    [
        (2, 2, Heads(0, 0, 2), "pages split into 1 x 4 heads here, 2 x 2 there"),
        (2, 1, Heads(3, 0, 2), "heads 3..4 into 0..1, but the pages hold 4 heads here"),
        (2, 1, None, "page size 128 here but 64 there"),
    ],
)
def test_layouts_that_do_not_fit_are_refused_before_any_byte_moves(
    peers: list[Peer], rx_heads: int, rx_outer: int, heads: Heads | None, message: str
) -> None:
    tx = Peer("sender", spec_of(4, 1), None, geometry(4, 1, ["l0", "l1"]))
    rx = Peer(
        "receiver", spec_of(rx_heads, rx_outer), None, geometry(rx_heads, rx_outer, ["l0", "l1"])
    )
    peers += [tx, rx]
    kind, why = tx.error_of("write", 4, np.arange(2), [rx.target(np.arange(2), heads=heads)], 30.0)
    assert kind == "LayoutError" and message in why, why
    assert all((layer == FILL).all() for layer in rx.layers())


def test_named_buffers_missing_on_the_receiver_are_refused(peers: list[Peer]) -> None:
    tx = Peer("sender", spec_of(2, 1), None, geometry(2, 1, ["l0", "l9"]))
    rx = Peer("receiver", spec_of(2, 1), None, geometry(2, 1, ["l0", "l1"]))
    peers += [tx, rx]
    kind, why = tx.error_of("write", 5, np.arange(2), [rx.target(np.arange(2))], 30.0)
    assert kind == "LayoutError" and "registered no buffer named ['l9']" in why, why
    assert all((layer == FILL).all() for layer in rx.layers())
