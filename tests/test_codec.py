"""The run-length page-index codec: every valid index array round-trips exactly, the
int32 edge included, in as few runs as it has; what it refuses, it refuses as
CorruptStateError, whatever the bytes. And transports.pages.merge_runs, the transfer
side's run builder: every (src, dst) pair kept in order, in maximal runs."""

from __future__ import annotations

from unittest.mock import patch

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvstate import codec
from kvstate.codec import (
    MAX_INDEX,
    MAX_PAGES,
    TransferInfo,
    as_indices,
    decode_runs,
    encode_runs,
    pack,
    unpack,
)
from kvstate.errors import CorruptStateError, InvalidIndicesError
from transports.pages import merge_runs

# Page indices anywhere in [0, 2**31 - 1]; runs come from consecutive stretches, so
# also build arrays from (start, length) pieces that reach the top of the range.
any_indices = arrays(np.int64, st.integers(0, 64), elements=st.integers(0, MAX_INDEX))


@st.composite
def runs(draw: st.DrawFn) -> np.ndarray:
    pieces = []
    for _ in range(draw(st.integers(0, 8))):
        length = draw(st.integers(1, 50))
        start = draw(st.integers(0, MAX_INDEX - length + 1))
        pieces.append(np.arange(start, start + length, dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


@settings(max_examples=100, deadline=None)
@given(st.one_of(any_indices, runs()))
def test_runs_round_trip(indices: np.ndarray) -> None:
    idx = as_indices(indices)
    raw = encode_runs(idx)
    back = decode_runs(raw, "k", "f")
    assert back.dtype == np.int32
    np.testing.assert_array_equal(back, indices)
    assert len(raw) % 8 == 0 and len(raw) <= 8 * max(len(indices), 1)


@settings(max_examples=100, deadline=None)
@given(runs(), st.integers(0, 2**31 - 1), st.booleans())
def test_transfer_info_round_trip(kv: np.ndarray, prefix: int, dummy: bool) -> None:
    info = TransferInfo("r", as_indices(kv), None, as_indices(kv[::-1]), prefix, dummy, "inc")
    back = TransferInfo.decode("r", info.encode(), "k")
    np.testing.assert_array_equal(back.kv_indices, kv)
    assert back.state_indices is not None
    np.testing.assert_array_equal(back.state_indices, kv[::-1])
    assert (back.prefix_len, back.dummy, back.incarnation) == (prefix, dummy, "inc")


def test_transfer_info_leaves_defaults_out_and_reads_them_written() -> None:
    """Prefix 0 and not dummy are not stored (each costs its name in every room hash);
    an info that spells them (as kvstate wrote them before) reads the same."""
    kv = as_indices(np.arange(64, 128))
    plain = TransferInfo("r", kv, incarnation="inc")
    doc = unpack(plain.encode(), "k", "f")
    assert "prefix" not in doc and "dummy" not in doc
    assert unpack(TransferInfo("r", kv, None, None, 16, True, "inc").encode(), "k", "f") | {
        "kv": b""
    } == {"v": doc["v"], "kv": b"", "inc": "inc", "prefix": 16, "dummy": True}
    old = msgpack.packb({**doc, "prefix": 0, "dummy": False}, use_bin_type=True)
    back = TransferInfo.decode("r", old, "k")
    assert (back.prefix_len, back.dummy, back.incarnation) == (0, False, "inc")
    np.testing.assert_array_equal(back.kv_indices, kv)


def _runs_in(indices: np.ndarray) -> int:
    """How many maximal stretches of consecutive pages ``indices`` holds (plain Python)."""
    values = indices.tolist()
    return sum(1 for i, v in enumerate(values) if i == 0 or v != values[i - 1] + 1)


@settings(max_examples=100, deadline=None)
@given(st.one_of(any_indices, runs()))
def test_encoding_is_one_pair_per_maximal_run(indices: np.ndarray) -> None:
    raw = encode_runs(as_indices(indices))
    assert len(raw) == 8 * _runs_in(indices)
    pairs = np.frombuffer(raw, dtype="<i4").reshape(-1, 2).astype(np.int64)
    # maximal: no run continues the one before it
    assert not (pairs[1:, 0] == pairs[:-1, 0] + pairs[:-1, 1]).any()


@settings(max_examples=100, deadline=None)
@given(st.one_of(any_indices, runs()))
def test_few_pages_encode_as_numpy_encodes_many(indices: np.ndarray) -> None:
    """Below codec._FEW pages the runs are found in Python: the same bytes as numpy's."""
    idx = as_indices(indices)
    if idx.size:
        few = codec._few_runs(idx.tolist())
        with patch.object(codec, "_FEW", 0):
            assert encode_runs(idx) == few


int32 = st.integers(-(2**31), 2**31 - 1)
big = st.integers(2**30, 2**31 - 1)


@st.composite
def stored_runs(draw: st.DrawFn) -> bytes:
    """Run lists as anything could have written them: any int32 start with lengths
    that are bad or small; at times a run that goes past the last page, or two huge
    runs that repeat pages (both refused before any array is made: a valid run of 2**30
    pages would take 8 GiB to decode); at times bytes that are not pairs."""
    pairs = draw(st.lists(st.tuples(int32, st.integers(-2, 300)), max_size=6))
    if draw(st.booleans()):
        length = draw(big)
        pairs.append((draw(st.integers(MAX_INDEX - length + 2, MAX_INDEX)), length))
    if draw(st.booleans()):
        pairs += [(0, 2**30 + 1), (draw(st.integers(0, 2**30 - 2)), 2**30)]
    draw(st.randoms()).shuffle(pairs)
    tail = draw(st.sampled_from([b"", b"", b"\x01", b"\x00\x00\x00"]))
    return np.array(pairs, dtype="<i4").reshape(-1, 2).tobytes() + tail


@settings(max_examples=150, deadline=None)
@given(stored_runs())
def test_any_stored_runs_decode_or_are_corrupt(raw: bytes) -> None:
    """Whatever is stored: a valid index array, or CorruptStateError naming key and field."""
    try:
        back = decode_runs(raw, "k", "f")
    except CorruptStateError as exc:
        assert (exc.key, exc.field) == ("k", "f")
        return
    assert back.dtype == np.int32 and (back >= 0).all()
    np.testing.assert_array_equal(decode_runs(encode_runs(back), "k", "f"), back)


def _decoded(raw: bytes, max_pages: int) -> object:
    try:
        return decode_runs(raw, "k", "f", max_pages).tolist()
    except CorruptStateError as exc:
        return str(exc)


@settings(max_examples=150, deadline=None)
@given(st.one_of(stored_runs(), st.builds(lambda a: encode_runs(as_indices(a)), runs())))
def test_few_runs_decode_as_numpy_decodes_many(raw: bytes) -> None:
    """Up to codec._FEW runs (and _FEW_PAGES pages) are checked and made in Python: the
    same pages, or the same refusal, as numpy's, with and without a page limit."""
    for max_pages in (MAX_PAGES, 40):
        few = _decoded(raw, max_pages)
        with patch.object(codec, "_FEW", 0):
            assert _decoded(raw, max_pages) == few


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_as_a_transfer_info_are_corrupt_or_valid(raw: bytes) -> None:
    try:
        info = TransferInfo.decode("r", raw, "k")
    except CorruptStateError as exc:
        assert exc.key == "k"
        return
    assert info.kv_indices.dtype == np.int32  # only msgpack of the right shape gets here


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=4), max_size=4
    )
)
def test_payload_without_our_version_is_corrupt(doc: dict[str, object]) -> None:
    import msgpack

    raw = msgpack.packb({**doc, "v": 99}, use_bin_type=True)
    with pytest.raises(CorruptStateError, match="schema version 99"):
        unpack(raw, "k", "f")


# --------------------------------------------------------------------------- merge_runs

pages = st.integers(0, 1 << 20)


@st.composite
def page_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of one transfer: stretches contiguous on one side, both or neither."""
    src: list[int] = []
    dst: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        n = draw(st.integers(1, 12))
        s0, d0 = draw(pages), draw(pages)
        src += (
            [s0 + i for i in range(n)]
            if draw(st.booleans())
            else draw(st.lists(pages, min_size=n, max_size=n))
        )
        dst += (
            [d0 + i for i in range(n)]
            if draw(st.booleans())
            else draw(st.lists(pages, min_size=n, max_size=n))
        )
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@settings(max_examples=100, deadline=None)
@given(page_pairs())
def test_merge_runs_keeps_every_pair_in_maximal_runs(pair: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = pair
    runs = merge_runs(src, dst)
    assert (runs.length >= 1).all() and runs.pages == src.size
    expanded = [
        (s + i, d + i)
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True)
        for i in range(n)
    ]
    assert expanded == list(zip(src.tolist(), dst.tolist(), strict=True))
    # maximal: a run never continues the one before it on both sides
    follows = (runs.src[1:] == runs.src[:-1] + runs.length[:-1]) & (
        runs.dst[1:] == runs.dst[:-1] + runs.length[:-1]
    )
    assert not follows.any()


def test_top_page_index_decodes() -> None:
    """2**31 - 1 is accepted by as_indices, so it must decode (it used to be refused)."""
    for arr in ([MAX_INDEX], [MAX_INDEX - 1, MAX_INDEX], [0, MAX_INDEX]):
        np.testing.assert_array_equal(decode_runs(encode_runs(as_indices(arr)), "k", "f"), arr)


@pytest.mark.parametrize(
    "pairs",
    [
        [(-1, 1)],
        [(0, 0)],
        [(5, -2)],
        [(MAX_INDEX, 2)],
        [(0, 1), (MAX_INDEX - 1, 3)],
        [(0, 2**30 + 1), (7, 2**30)],  # each fits; together more pages than exist
    ],
)
def test_bad_runs_are_corrupt(pairs: list[tuple[int, int]]) -> None:
    raw = np.array(pairs, dtype="<i4").tobytes()
    with pytest.raises(CorruptStateError):
        decode_runs(raw, "k", "f")


@settings(max_examples=100, deadline=None)
@given(st.one_of(any_indices, runs()))
def test_runs_round_trip_a_few_runs_at_a_time(indices: np.ndarray) -> None:
    """decode_runs checks and decodes the runs ``_CHUNK`` at a time (2^16): the same
    pages whatever the chunk, its edges included."""
    saved = codec._CHUNK
    codec._CHUNK = 3
    try:
        back = decode_runs(encode_runs(as_indices(indices)), "k", "f")
    finally:
        codec._CHUNK = saved
    np.testing.assert_array_equal(back, indices)


@pytest.mark.parametrize(
    "pairs",
    [
        [(0, MAX_INDEX), (0, 1)],  # 2^31 pages in a 30-byte info (issue 30)
        [(0, 2**26)],  # 1 GiB and 3 s per decode before
        [(0, MAX_PAGES + 1)],
        [(0, MAX_PAGES), (MAX_PAGES + 5, 1)],
    ],
    ids=["2^31", "2^26", "MAX_PAGES+1", "MAX_PAGES+1 in two"],
)
def test_too_many_pages_are_corrupt_before_any_allocation(pairs: list[tuple[int, int]]) -> None:
    """Page counts are bounded (MAX_PAGES, or the caller's smaller bound) before anything
    the size of the pages is allocated: a hostile info costs no memory."""
    import tracemalloc

    raw = pack({"kv": np.array(pairs, dtype="<i4").tobytes(), "inc": ""})
    assert len(raw) < 50
    tracemalloc.start()
    try:
        with pytest.raises(CorruptStateError, match="more than"):
            TransferInfo.decode("r", raw, "k", "f")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def test_page_bounds_at_the_edges() -> None:
    """MAX_PAGES pages decode; a caller's own bound (``max_pages``) is kept; more runs
    than pages allowed are refused unread; a receiver may not publish more."""
    back = decode_runs(np.array([(0, MAX_PAGES)], dtype="<i4").tobytes(), "k", "f")
    assert back.size == MAX_PAGES and back[-1] == MAX_PAGES - 1
    raw = np.array([(0, 11)], dtype="<i4").tobytes()
    assert decode_runs(raw, "k", "f", max_pages=11).size == 11
    with pytest.raises(CorruptStateError, match="over 10 pages"):
        decode_runs(raw, "k", "f", max_pages=10)
    with pytest.raises(CorruptStateError, match="runs: more than"):
        decode_runs(b"\x00" * 8 * 3, "k", "f", max_pages=2)
    info = TransferInfo("r", as_indices(np.arange(11)), incarnation="").encode()
    assert TransferInfo.decode("r", info, "k", "f", max_pages=11).kv_indices.size == 11
    with pytest.raises(CorruptStateError, match="over 10 pages"):
        TransferInfo.decode("r", info, "k", "f", max_pages=10)
    with pytest.raises(InvalidIndicesError, match="MAX_PAGES"):
        as_indices(np.arange(MAX_PAGES + 1, dtype=np.int32))


@pytest.mark.parametrize(
    "extra", [{"aux": 2**31}, {"aux": True}, {"prefix": 2**63}, {"prefix": -1}, {"aux": -1}]
)
def test_out_of_range_info_fields_are_corrupt(extra: dict[str, object]) -> None:
    raw = pack({"kv": encode_runs(as_indices([1, 2])), "inc": "", **extra})
    with pytest.raises(CorruptStateError):
        TransferInfo.decode("r", raw, "k", "f")


def test_top_page_index_through_redis(redis_url: str) -> None:
    """A receiver publishing page 2**31 - 1: its sender reads it back."""
    import kvstate
    from tests.helpers import PREFILL_ADDR, managers

    store = kvstate.connect(redis_url, namespace="codec")
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        rcv.init([MAX_INDEX - 2, MAX_INDEX])
        snd.poll()
        infos = snd.transfer_infos()
        np.testing.assert_array_equal(infos[d.engine].kv_indices, [MAX_INDEX - 2, MAX_INDEX])
        snd.clear()
        rcv.clear()
    store.close()
