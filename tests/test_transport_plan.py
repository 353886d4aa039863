"""What a write plans, without moving a byte: each buffer's UCX puts and the same-host
iovecs cover exactly the bytes a page-by-page reckoning names (buffers of several page
sizes in turn, KV heads cut, several runs), each put list goes with its own buffer and
the receiver's buffer of its rkey, and a receiver's pairing is kept between rooms only
while its layout and the local buffers are the ones it was made from."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from transports import cma
from transports.base import Geometry, Heads, Target

pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")
from transports.ucx.buffers import Region  # noqa: E402
from transports.ucx.pairing import LAYOUT_VERSION  # noqa: E402
from transports.ucx.plan import Plan, make_plans  # noqa: E402

PAGES = 32
# (page bytes, heads per page) of each buffer, page sizes in turn: attention layers
# beside a state buffer not split by heads (heads 0), as a hybrid model registers
SPEC = [(1024, 4), (256, 0), (1024, 4), (256, 0), (512, 4)]
HERE = cma.Identity.here()


def regions(spec: list[tuple[int, int]] = SPEC) -> list[Region]:
    out = []
    for i, (pb, heads) in enumerate(spec):
        buf = np.zeros(PAGES * pb, dtype=np.uint8)
        geometry = Geometry(f"layer.{i}", heads, 1)
        out.append(Region(buf, buf.ctypes.data, buf.nbytes, pb, PAGES, "host", geometry=geometry))
    return out


def layout(base: int, spec: list[tuple[int, int]] = SPEC) -> dict[str, Any]:
    """A receiver's layout: its buffers at ``base`` apart, each with an rkey of its own."""
    buffers = [
        {
            "addr": base + i * (1 << 24),
            "nbytes": PAGES * pb,
            "page_bytes": pb,
            "num_pages": PAGES,
            "memory": "host",
            "rkey": f"rkey-{i}".encode(),
            "name": f"layer.{i}",
            "heads": heads,
            "outer": 1,
        }
        for i, (pb, heads) in enumerate(spec)
    ]
    return {"transport": "ucx", "version": LAYOUT_VERSION, "id": HERE.as_dict(), "buffers": buffers}


def plan(
    src: np.ndarray,
    target: Target,
    local: list[Region],
    kept: dict[tuple[Any, ...], Any] | None = None,
    put_chunk: int = 0,
) -> Plan:
    (out,) = make_plans(1, src, [target], local, HERE, (), put_chunk, None, kept)
    return out


def reckoned(
    src: np.ndarray, dst: np.ndarray, local: list[Region], lay: dict[str, Any], heads: Heads | None
) -> list[tuple[int, int, int]]:
    """Page by page (and head by head where one is cut): (local address, remote address,
    bytes) of every piece that must move."""
    out = []
    for r, b in zip(local, lay["buffers"], strict=True):
        pb, nh = r.page_bytes, r.geometry.heads
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            if heads is None or nh == 0:
                out.append((r.addr + s * pb, b["addr"] + d * pb, pb))
            else:
                chunk = pb // nh
                lo, ro = r.addr + s * pb + heads.src * chunk, b["addr"] + d * pb + heads.dst * chunk
                out.append((lo, ro, heads.count * chunk))
    return sorted(out)


def pieces(spans: list[tuple[int, int, int]], size: dict[int, int]) -> list[tuple[int, int, int]]:
    """Spans cut into the pieces ``reckoned`` lists (``size``: a piece's bytes by the
    buffer a local address falls in, keyed by the buffer's base)."""
    out = []
    for lo, ro, n in spans:
        base = max(b for b in size if b <= lo)
        step = size[base]
        assert n % step == 0, (lo, n, step)
        out += [(lo + k, ro + k, step) for k in range(0, n, step)]
    return sorted(out)


@pytest.mark.parametrize("heads", [None, Heads(1, 2, 2)], ids=["whole-pages", "heads-cut"])
def test_puts_and_iovecs_cover_exactly_the_reckoned_bytes(heads: Heads | None) -> None:
    rng = np.random.default_rng(5)
    local, lay = regions(), layout(1 << 40)
    src = np.concatenate([np.arange(3, 9), [20, 21], rng.permutation(np.arange(10, 18))[:5]])
    dst = np.concatenate([np.arange(0, 6), [30, 12], [25, 26, 27, 6, 7]])
    p = plan(src, Target(b"ep", lay, dst, heads), local)
    want = reckoned(src, dst, local, lay, heads)
    size = {}
    for r in local:
        nh = r.geometry.heads
        size[r.addr] = (
            r.page_bytes if heads is None or nh == 0 else heads.count * r.page_bytes // nh
        )
    assert p.nbytes == sum(n for _, _, n in want)
    assert p.local_iov is not None and p.remote_iov is not None  # same host: the iovecs
    iov = zip(p.local_iov[:, 0], p.remote_iov[:, 0], p.local_iov[:, 1], strict=True)
    assert pieces([(int(a), int(b), int(n)) for a, b, n in iov], size) == want
    # the puts: each list within its own buffer here and the buffer of its rkey there
    remote_of = {b["rkey"]: b for b in lay["buffers"]}
    spans = []
    for r, rkey, (la, ra, n) in zip(p.regions, p.rkeys, p.ops, strict=True):
        rb = remote_of[rkey]
        assert rb["name"] == r.geometry.name
        for lo, ro, k in zip(la, ra, n, strict=True):
            assert r.addr <= lo and lo + k <= r.addr + r.nbytes
            assert rb["addr"] <= ro and ro + k <= rb["addr"] + rb["nbytes"]
            spans.append((lo, ro, k))
    assert pieces(spans, size) == want


def test_puts_cut_to_the_chunk_keep_their_buffers() -> None:
    local, lay = regions(), layout(1 << 40)
    lay["id"] = None  # a peer of unknown place: UCX puts, cut
    src = dst = np.arange(0, 8)
    p = plan(src, Target(b"ep", lay, dst), local, put_chunk=700)
    assert p.peer is None
    for r, (la, _, n) in zip(p.regions, p.ops, strict=True):
        assert max(n) <= 700 and sum(n) == 8 * r.page_bytes
        assert all(
            r.addr <= lo and lo + k <= r.addr + r.nbytes for lo, k in zip(la, n, strict=True)
        )


def test_a_pairing_is_kept_only_for_the_layout_and_buffers_it_was_made_from() -> None:
    local, lay = regions(), layout(1 << 40)
    kept: dict[tuple[Any, ...], Any] = {}
    src, dst = np.arange(4), np.arange(8, 12)
    first = plan(src, Target(b"ep", lay, dst), local, kept)
    again = plan(src + 4, Target(b"ep", lay, dst + 4), local, kept)
    assert again.pairing is first.pairing  # made once for the receiver
    assert int(again.remote_iov[0, 0]) == int(first.remote_iov[0, 0]) + 4 * SPEC[0][0]  # type: ignore[index]
    # a receiver registered again (the layout read anew, its buffers elsewhere)
    moved = layout(1 << 41)
    p = plan(src, Target(b"ep", moved, dst), local, kept)
    assert p.pairing is not first.pairing
    assert int(p.remote_iov[0, 0]) == (1 << 41) + 8 * SPEC[0][0]  # type: ignore[index]
    # this side registered again: its new buffers are read, not the old ones
    fresh = regions()
    p = plan(src, Target(b"ep", moved, dst), fresh, kept)
    assert {r.addr for r in p.regions} == {r.addr for r in fresh}
    assert int(p.local_iov[0, 0]) == fresh[0].addr  # type: ignore[index]
    # other heads for the same receiver: a pairing of its own
    cut = plan(src, Target(b"ep", moved, dst, Heads(0, 0, 2)), fresh, kept)
    assert cut.pairing is not p.pairing and cut.nbytes < p.nbytes
