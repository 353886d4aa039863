"""Writes cut into pieces: UCX puts of at most ``put_chunk`` bytes, same-host writes
split over threads. Every byte must land where it belongs, and an error in any piece
must surface (after the other pieces are done)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.helpers import scaled
from transports import cma


def _runs(rng: np.random.Generator, n: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of ``n`` runs laid end to end with gaps, lengths 1..max_len."""
    length = rng.integers(1, max_len + 1, n).astype(np.int64)
    gaps = rng.integers(0, 64, n).astype(np.int64)
    offset = np.cumsum(gaps + length) - length
    return offset, length


def _each_byte(iov: np.ndarray) -> np.ndarray:
    """Every byte address an iovec array covers, in order."""
    return np.concatenate([np.arange(int(a), int(a) + int(n)) for a, n in iov])


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_split_iovecs_keeps_every_byte_in_order(parts: int) -> None:
    rng = np.random.default_rng(parts)
    off, length = _runs(rng, 40, 5000)
    local = cma.iovecs((1 << 20) + off, length)
    remote = cma.iovecs((1 << 30) + off[::-1].copy(), length)
    pieces = cma.split_iovecs(local, remote, parts)
    assert len(pieces) == parts
    sizes = [int(lp[:, 1].sum()) for lp, _ in pieces]
    assert sum(sizes) == int(length.sum())
    assert max(sizes) - min(sizes) <= 1
    for lp, rp in pieces:
        assert (lp[:, 1] == rp[:, 1]).all() and (lp[:, 1] > 0).all()
    # Byte for byte, the pieces pair the same source and destination addresses.
    assert (np.concatenate([_each_byte(lp) for lp, _ in pieces]) == _each_byte(local)).all()
    assert (np.concatenate([_each_byte(rp) for _, rp in pieces]) == _each_byte(remote)).all()


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threaded_write_runs_lands_every_byte(threads: int) -> None:
    """process_vm_writev into this very process: the pieces of a split write, written by
    several threads at once, leave exactly the bytes a single copy would."""
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_off, length = _runs(rng, 60, 9000)
    d_off = rng.permutation(s_off.size)
    # Destination runs at distinct places: lay them end to end in a shuffled order.
    d_start = np.empty_like(s_off)
    d_start[d_off] = np.cumsum(length[d_off]) - length[d_off]
    local = cma.iovecs(src.ctypes.data + s_off, length)
    remote = cma.iovecs(dst.ctypes.data + d_start, length)
    got = cma.write_runs(os.getpid(), local, remote, "self", threads=threads, min_part=1)
    assert got == int(length.sum())
    want = np.zeros_like(src)
    for so, do, n in zip(s_off, d_start, length, strict=True):
        want[do : do + n] = src[so : so + n]
    assert (dst == want).all()


def test_an_error_in_one_piece_surfaces() -> None:
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    length = np.array([1 << 14] * 4, dtype=np.int64)
    local = cma.iovecs(src.ctypes.data + np.arange(4) * (1 << 14), length)
    remote = cma.iovecs(dst.ctypes.data + np.arange(4) * (1 << 14), length)
    remote[3, 0] = np.uint64(4096)  # nothing is mapped there
    with pytest.raises(cma.CMAError) as err:
        cma.write_runs(os.getpid(), local, remote, "self", threads=4, min_part=1)
    assert "self" in str(err.value)
    # The good pieces were written all the same: nothing was left half-started.
    assert (dst[: 3 << 14] == src[: 3 << 14]).all()


def test_split_spans_cuts_puts_to_the_chunk() -> None:
    pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")
    from transports.ucx.plan import split_spans

    rng = np.random.default_rng(3)
    off, length = _runs(rng, 30, 20000)
    laddr, raddr = 1000 + off, 5_000_000 + off[::-1].copy()
    for chunk in (1, 1000, 4096, 1 << 20):
        lo, ro, n = split_spans(laddr, raddr, length, chunk)
        assert int(n.max()) <= chunk and (n > 0).all()
        assert int(n.sum()) == int(length.sum())
        assert ((ro - lo) == np.repeat(raddr - laddr, (length + chunk - 1) // chunk)).all()
        # Byte for byte, the pieces pair the same local and remote addresses, in order.
        assert (_each_byte(np.stack([lo, n], 1)) == _each_byte(np.stack([laddr, length], 1))).all()
        assert (_each_byte(np.stack([ro, n], 1)) == _each_byte(np.stack([raddr, length], 1))).all()


def test_a_forked_child_gets_its_own_threads() -> None:
    """After fork the parent's pool threads do not exist in the child: a split write
    there must still run (not wait forever on a queue nobody serves)."""
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    length = np.array([1 << 14] * 4, dtype=np.int64)
    local = cma.iovecs(src.ctypes.data + np.arange(4) * (1 << 14), length)
    remote = cma.iovecs(dst.ctypes.data + np.arange(4) * (1 << 14), length)
    cma.write_runs(os.getpid(), local, remote, "self", threads=3, min_part=1)  # pool made
    pid = os.fork()
    if pid == 0:  # the child: copy again into its own memory, exit 0 if all landed
        code = 1
        try:
            dst.fill(0)
            cma.write_runs(os.getpid(), local, remote, "self", threads=3, min_part=1)
            code = 0 if (dst == src).all() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + scaled(30)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the split write hung in the forked child")


def test_puts_to_a_peer_on_this_host_and_network_are_whole_runs() -> None:
    """UCX reaches a peer on this host and network namespace over cma, where whole runs
    beat 64 KiB puts; another network namespace (a container, the benchmark's stand-in
    for another host), another host, or a peer whose layout does not say its namespace
    (an older one) keeps the cut."""
    pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")
    import dataclasses

    from transports.ucx.plan import chunk_for

    here = cma.Identity.here()
    assert here.net_ns, "this host has /proc/self/ns/net"
    twin = cma.Identity.from_dict(here.as_dict())
    assert chunk_for(65536, here, twin) == 0
    assert chunk_for(65536, here, dataclasses.replace(here, net_ns="net:[1]")) == 65536
    assert chunk_for(65536, here, dataclasses.replace(here, boot_id="other")) == 65536
    older = {k: v for k, v in here.as_dict().items() if k != "net_ns"}
    assert cma.Identity.from_dict(older) is not None  # still readable, CMA still allowed
    assert chunk_for(65536, here, cma.Identity.from_dict(older)) == 65536
    assert chunk_for(65536, None, twin) == chunk_for(65536, here, None) == 65536
