"""Small helpers shared by the state tests (not fixtures: plain functions)."""

from __future__ import annotations

import time
from collections.abc import Callable

import kvstate
from kvstate.store import Store

PREFILL_ADDR = "10.0.0.1:8998"


def keys_of(store: Store, pattern: str | None = None) -> list[str]:
    return sorted(store.scan(pattern or store.keys.all_pattern))


def room_keys(store: Store, room: int) -> list[str]:
    return keys_of(store, store.keys.room_prefix(room) + "*")


def assert_every_key_has_ttl(store: Store) -> None:
    """Design rule 1, checked by scanning every key of the namespace."""
    missing = []
    for key in keys_of(store):
        node = store.client
        pttl = node.pttl(key)
        if pttl < 0:
            missing.append((key, pttl))
    assert not missing, f"keys without TTL: {missing}"


def managers(store: Store, **kw: object) -> tuple[kvstate.KVManager, kvstate.KVManager]:
    p = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, **kw)  # type: ignore[arg-type]
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998", **kw)  # type: ignore[arg-type]
    return p, d


def wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
