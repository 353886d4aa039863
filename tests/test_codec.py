"""The run-length page-index codec: every valid index array round-trips exactly, the
int32 edge included; and what it refuses, it refuses as CorruptStateError."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvstate.codec import MAX_INDEX, TransferInfo, as_indices, decode_runs, encode_runs
from kvstate.errors import CorruptStateError

# Page indices anywhere in [0, 2**31 - 1]; runs come from consecutive stretches, so
# also build arrays from (start, length) pieces that reach the top of the range.
any_indices = arrays(np.int64, st.integers(0, 200), elements=st.integers(0, MAX_INDEX))


@st.composite
def runs(draw: st.DrawFn) -> np.ndarray:
    pieces = []
    for _ in range(draw(st.integers(0, 8))):
        length = draw(st.integers(1, 50))
        start = draw(st.integers(0, MAX_INDEX - length + 1))
        pieces.append(np.arange(start, start + length, dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


@settings(max_examples=300, deadline=None)
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


def test_top_page_index_decodes() -> None:
    """2**31 - 1 is accepted by as_indices, so it must decode (it used to be refused)."""
    for arr in ([MAX_INDEX], [MAX_INDEX - 1, MAX_INDEX], [0, MAX_INDEX]):
        np.testing.assert_array_equal(decode_runs(encode_runs(as_indices(arr)), "k", "f"), arr)


@pytest.mark.parametrize(
    "pairs", [[(-1, 1)], [(0, 0)], [(5, -2)], [(MAX_INDEX, 2)], [(0, 1), (MAX_INDEX - 1, 3)]]
)
def test_bad_runs_are_corrupt(pairs: list[tuple[int, int]]) -> None:
    raw = np.array(pairs, dtype="<i4").tobytes()
    with pytest.raises(CorruptStateError):
        decode_runs(raw, "k", "f")


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
