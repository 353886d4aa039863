"""msgpack payloads with a schema version, and run-length page indices.

Only structured payloads are msgpack (design rule 6). Page indices are stored as
little-endian int32 ``(start, length)`` pairs, so a contiguous 4096-page
allocation costs 8 bytes instead of 16 KiB. Decoding is strict: anything that
does not match the schema raises CorruptStateError naming the key and field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvstate.errors import CorruptStateError, InvalidIndicesError
from kvstate.schema import MAX_PEERS

SCHEMA_VERSION = 1
MAX_INDEX = 2**31 - 1
# The most pages one transfer info may list (kv and state indices alike): 16,777,216,
# a 16M-token request at one token per page, 64 MiB decoded. A receiver is refused
# more at init(); a stored info listing more is corrupt, refused before anything the
# size of its pages is allocated (a 30-byte info could list 2^31 pages: issue 30).
MAX_PAGES = 2**24
IndexArray = npt.NDArray[np.int32]
# Up to _FEW pages (encoding) or _FEW runs of at most _FEW_PAGES pages (decoding), runs
# are made in Python: numpy's 10-15 calls cost 20-35 us whatever the size, and a step
# pays them per room (a decode's admission encodes, a prefill's push decodes; issue 33)
_FEW = 64
_FEW_PAGES = 512
_PAIR = np.dtype("<i4")


def is_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python): counts and indices passed
    by the caller are checked with it before anything is encoded or sent."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_indices(value: object, what: str = "kv_indices") -> IndexArray:
    """Validate a page-index array: 1-D, integer, non-negative, fits int32."""
    arr = np.asarray(value)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1:
        raise InvalidIndicesError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidIndicesError(f"{what} must hold integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise InvalidIndicesError(f"{what} holds a negative page index ({lo})")
    if hi > MAX_INDEX:
        raise InvalidIndicesError(f"{what} holds page index {hi}, above the int32 limit")
    if arr.size > MAX_PAGES:
        raise InvalidIndicesError(
            f"{what} lists {arr.size} pages, more than one transfer carries "
            f"(kvstate.codec.MAX_PAGES, {MAX_PAGES})"
        )
    return arr.astype(np.int32, copy=False)


def encode_runs(indices: IndexArray) -> bytes:
    """``indices`` as ``(start, length)`` int32 pairs, one per maximal run."""
    if indices.size == 0:
        return b""
    if indices.size <= _FEW:
        return _few_runs(indices.tolist())
    idx = indices.astype(np.int64)
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    bounds = np.concatenate(([0], breaks, [idx.size]))
    pairs = np.empty((bounds.size - 1, 2), dtype=_PAIR)
    pairs[:, 0] = idx[bounds[:-1]]
    pairs[:, 1] = np.diff(bounds)
    return pairs.tobytes()


def _few_runs(pages: list[int]) -> bytes:
    flat: list[int] = []
    start = prev = pages[0]
    for page in pages[1:]:
        if page != prev + 1:
            flat += (start, prev - start + 1)
            start = page
        prev = page
    flat += (start, prev - start + 1)
    return struct.pack(f"<{len(flat)}i", *flat)


_CHUNK = 2**16  # runs handled at a time: their int64 temporaries stay ~3 MiB


def decode_runs(raw: bytes, key: str, field_name: str, max_pages: int = MAX_PAGES) -> IndexArray:
    """Page indices from ``(start, length)`` int32 pairs, in bounded memory: the runs
    are checked, ``_CHUNK`` at a time, and their total against ``max_pages`` (at most
    MAX_PAGES) before anything the size of the pages is allocated; the pages are then
    made in place as int32 (4 bytes a page, no int64 copy of them). A hostile info costs
    its own size and at most ``max_pages`` pages."""
    limit = min(max_pages, MAX_PAGES)
    if len(raw) % 8:
        raise CorruptStateError(key, field_name, f"run list of {len(raw)} bytes is not pairs")
    if len(raw) // 8 > limit:
        raise CorruptStateError(
            key, field_name, f"{len(raw) // 8} runs: more than the {limit} pages allowed"
        )
    if len(raw) <= 8 * _FEW:  # a few runs: checked in Python, as below
        few = _few_pages(raw, key, field_name, limit)
        if few is not None:
            return few
    pairs = np.frombuffer(raw, dtype=_PAIR).reshape(-1, 2)
    if pairs.size == 0:
        return np.empty(0, dtype=np.int32)
    total = 0
    for at in range(0, len(pairs), _CHUNK):
        starts, lengths = _run_chunk(pairs, at)
        total += int(lengths.sum())
        _check_runs(
            bool((starts < 0).any() or (lengths <= 0).any()),
            int((starts + lengths - 1).max()),  # the last page of a run, the highest
            total,
            limit,
            key,
            field_name,
        )
    # each page is the one before it + 1, but at a run's first page, which jumps from
    # the last run's last page: ones, the jumps at the runs' first pages, then a
    # running sum, in place (every partial sum is a page index: int32 holds it)
    out: IndexArray = np.ones(total, dtype=np.int32)
    page, last = 0, 0  # where this chunk's first run starts in ``out``; the page before
    for at in range(0, len(pairs), _CHUNK):
        starts, lengths = _run_chunk(pairs, at)
        firsts = page + np.cumsum(lengths) - lengths
        jumps = starts.copy()
        jumps[1:] -= starts[:-1] + lengths[:-1] - 1
        jumps[0] -= last
        out[firsts] = jumps
        page = int(firsts[-1] + lengths[-1])
        last = int(starts[-1] + lengths[-1] - 1)
    np.cumsum(out, dtype=np.int32, out=out)
    return out


def _few_pages(raw: bytes, key: str, field_name: str, limit: int) -> IndexArray | None:
    """``decode_runs`` of at most ``_FEW`` runs, the same checks in the same order;
    None when they hold over ``_FEW_PAGES`` pages (numpy makes those faster)."""
    flat = struct.unpack(f"<{len(raw) // 4}i", raw)
    starts, lengths = flat[0::2], flat[1::2]
    if not starts:
        return np.empty(0, dtype=np.int32)
    total = sum(lengths)
    _check_runs(
        min(starts) < 0 or min(lengths) <= 0,
        max(s + n - 1 for s, n in zip(starts, lengths, strict=True)),
        total,
        limit,
        key,
        field_name,
    )
    if total > _FEW_PAGES:
        return None
    pages = [p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)]
    return np.array(pages, dtype=np.int32)


def _check_runs(
    negative: bool, last: int, total: int, limit: int, key: str, field_name: str
) -> None:
    """Refuse runs with a negative start or length, a run past page MAX_INDEX (``last``:
    the highest last page), or more than ``limit`` pages in all (``total``), in that
    order: both decoders refuse alike."""
    if negative:
        raise CorruptStateError(key, field_name, "run list has a negative start or length")
    if last > MAX_INDEX:
        raise CorruptStateError(key, field_name, f"run list goes past page {MAX_INDEX}")
    if total > limit:
        raise CorruptStateError(
            key, field_name, f"run list holds over {limit} pages, more than allowed"
        )


def _run_chunk(
    pairs: npt.NDArray[np.int32], at: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(starts, lengths) of ``_CHUNK`` runs from ``at``, as int64 (sums cannot wrap)."""
    chunk = pairs[at : at + _CHUNK]
    return chunk[:, 0].astype(np.int64), chunk[:, 1].astype(np.int64)


@dataclass(frozen=True)
class TransferInfo:
    """What one receiver tells one sender: where to write, and what it has cached."""

    receiver: str
    kv_indices: IndexArray
    aux_index: int | None = None
    state_indices: IndexArray | None = None
    prefix_len: int = 0
    dummy: bool = False
    incarnation: str = ""  # the receiver engine's, so a sender never writes to a restarted one
    # the heads this sender writes, (its first, the receiver's first, how many): None is
    # whole pages (kvstate.tp, tensor parallelism of different sizes)
    heads: tuple[int, int, int] | None = None
    want: int = 0  # receivers the sender waits for, declared by them; 0: the sender's own

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"kv": encode_runs(self.kv_indices), "inc": self.incarnation}
        # absent fields keep small payloads under Redis's 64-byte listpack limit, and
        # the room hash small: defaults (prefix 0, not dummy) are not written
        if self.prefix_len:
            doc["prefix"] = self.prefix_len
        if self.dummy:
            doc["dummy"] = True
        if self.aux_index is not None:
            doc["aux"] = self.aux_index
        if self.state_indices is not None:
            doc["state"] = encode_runs(self.state_indices)
        if self.heads is not None:
            doc["heads"] = list(self.heads)
        if self.want:
            doc["want"] = self.want
        return pack(doc)

    @classmethod
    def decode(
        cls,
        receiver: str,
        raw: bytes,
        key: str,
        field_name: str | None = None,
        max_pages: int = MAX_PAGES,
    ) -> TransferInfo:
        """``raw`` as stored in ``key``'s field ``field_name`` (named in a
        CorruptStateError; ``receiver`` when not given). ``max_pages``: the most pages
        its runs may list (a sender that knows how many it sends passes that: more is
        corrupt before anything is allocated)."""
        where = receiver if field_name is None else field_name
        doc = unpack(raw, key, where)
        kv, aux, state = doc.get("kv"), doc.get("aux"), doc.get("state")
        prefix, dummy, inc = doc.get("prefix", 0), doc.get("dummy", False), doc.get("inc")
        if not isinstance(kv, bytes):
            raise CorruptStateError(key, where, "kv runs are not bytes")
        if aux is not None and (not is_int(aux) or not 0 <= aux <= MAX_INDEX):
            raise CorruptStateError(key, where, f"aux index {aux!r} is not an int32 >= 0")
        if state is not None and not isinstance(state, bytes):
            raise CorruptStateError(key, where, "state runs are not bytes")
        if not is_int(prefix) or not 0 <= prefix < 2**63:
            raise CorruptStateError(key, where, f"prefix length {prefix!r} is not an int >= 0")
        if not isinstance(dummy, bool):
            raise CorruptStateError(key, where, f"dummy flag {dummy!r} is not a bool")
        if not isinstance(inc, str):
            raise CorruptStateError(key, where, f"incarnation {inc!r} is not text")
        heads, want = doc.get("heads"), doc.get("want", 0)
        if heads is not None and not (
            isinstance(heads, list)
            and len(heads) == 3
            and all(is_int(h) and 0 <= h <= MAX_INDEX for h in heads)
            and heads[2] > 0
        ):
            raise CorruptStateError(key, where, f"heads {heads!r} are not [src, dst, count > 0]")
        if not is_int(want) or not 0 <= want <= MAX_PEERS:  # as the scripts read peers
            raise CorruptStateError(
                key, where, f"receivers declared {want!r} are not an int from 0 to {MAX_PEERS}"
            )
        return cls(
            receiver=receiver,
            kv_indices=decode_runs(kv, key, where, max_pages),
            aux_index=aux,
            state_indices=None if state is None else decode_runs(state, key, where, max_pages),
            prefix_len=prefix,
            dummy=dummy,
            incarnation=inc,
            heads=None if heads is None else (heads[0], heads[1], heads[2]),
            want=want,
        )


def pack(doc: dict[str, Any]) -> bytes:
    """Encode a payload with the schema version."""
    packed: bytes = msgpack.packb({"v": SCHEMA_VERSION, **doc}, use_bin_type=True)
    return packed


def unpack(raw: object, key: str, field_name: str) -> dict[str, Any]:
    """Decode a versioned payload; any deviation is CorruptStateError."""
    if not isinstance(raw, bytes):
        raise CorruptStateError(key, field_name, f"expected bytes, got {type(raw).__name__}")
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptStateError(key, field_name, f"not msgpack ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptStateError(key, field_name, f"expected a map, got {type(doc).__name__}")
    if doc.get("v") != SCHEMA_VERSION:
        raise CorruptStateError(
            key, field_name, f"schema version {doc.get('v')!r}, this kvstate reads {SCHEMA_VERSION}"
        )
    return doc
