"""msgpack payloads with a schema version, and run-length page indices.

Only structured payloads are msgpack (design rule 6). Page indices are stored as
little-endian int32 ``(start, length)`` pairs, so a contiguous 4096-page
allocation costs 8 bytes instead of 16 KiB. Decoding is strict: anything that
does not match the schema raises CorruptStateError naming the key and field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvstate.errors import CorruptStateError, InvalidIndicesError

SCHEMA_VERSION = 1
MAX_INDEX = 2**31 - 1
IndexArray = npt.NDArray[np.int32]
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
    return arr.astype(np.int32, copy=False)


def encode_runs(indices: IndexArray) -> bytes:
    if indices.size == 0:
        return b""
    idx = indices.astype(np.int64)
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    bounds = np.concatenate(([0], breaks, [idx.size]))
    pairs = np.empty((bounds.size - 1, 2), dtype=_PAIR)
    pairs[:, 0] = idx[bounds[:-1]]
    pairs[:, 1] = np.diff(bounds)
    return pairs.tobytes()


def decode_runs(raw: bytes, key: str, field_name: str) -> IndexArray:
    if len(raw) % 8:
        raise CorruptStateError(key, field_name, f"run list of {len(raw)} bytes is not pairs")
    pairs = np.frombuffer(raw, dtype=_PAIR).reshape(-1, 2).astype(np.int64)
    if pairs.size == 0:
        return np.empty(0, dtype=np.int32)
    starts, lengths = pairs[:, 0], pairs[:, 1]
    if (starts < 0).any() or (lengths <= 0).any():
        raise CorruptStateError(key, field_name, "run list has a negative start or length")
    if int((starts + lengths - 1).max()) > MAX_INDEX:  # a run's last page, not one past it
        raise CorruptStateError(key, field_name, f"run list goes past page {MAX_INDEX}")
    if int(lengths.sum()) > MAX_INDEX + 1:  # more pages than there are: repeats, and an
        raise CorruptStateError(key, field_name, "run list repeats pages")  # 8 GiB+ array
    offsets = np.cumsum(lengths) - lengths
    out: IndexArray = (np.arange(int(lengths.sum())) + np.repeat(starts - offsets, lengths)).astype(
        np.int32
    )
    return out


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
        cls, receiver: str, raw: bytes, key: str, field_name: str | None = None
    ) -> TransferInfo:
        """``raw`` as stored in ``key``'s field ``field_name`` (named in a
        CorruptStateError; ``receiver`` when not given)."""
        where = receiver if field_name is None else field_name
        doc = unpack(raw, key, where)
        kv, aux, state = doc.get("kv"), doc.get("aux"), doc.get("state")
        prefix, dummy, inc = doc.get("prefix", 0), doc.get("dummy", False), doc.get("inc")
        if not isinstance(kv, bytes):
            raise CorruptStateError(key, where, "kv runs are not bytes")
        if aux is not None and (not isinstance(aux, int) or aux < 0):
            raise CorruptStateError(key, where, f"aux index {aux!r} is not a non-negative int")
        if state is not None and not isinstance(state, bytes):
            raise CorruptStateError(key, where, "state runs are not bytes")
        if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
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
        if not is_int(want) or not 0 <= want <= MAX_INDEX:
            raise CorruptStateError(key, where, f"receivers declared {want!r} are not an int >= 0")
        return cls(
            receiver=receiver,
            kv_indices=decode_runs(kv, key, where),
            aux_index=aux,
            state_indices=None if state is None else decode_runs(state, key, where),
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
