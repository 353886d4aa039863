"""Small helpers shared by the state tests (not fixtures: plain functions).

Timing: every timeout and time bound in the tests goes through ``scaled()`` (and
``wait_for`` scales its own), stretched by ``$KVSTATE_TEST_TIME_FACTOR`` (default 1),
read once here, for slow or loaded hosts: ``KVSTATE_TEST_TIME_FACTOR=3 pytest``.
Durations that are the scenario itself (a lease, a timeout under test) are not scaled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import kvstate
from kvstate.store import Store

PREFILL_ADDR = "10.0.0.1:8998"


def _time_factor() -> float:
    raw = os.environ.get("KVSTATE_TEST_TIME_FACTOR", "") or "1"
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not 0 < factor < float("inf"):
        raise ValueError(f"KVSTATE_TEST_TIME_FACTOR must be a number > 0, e.g. 2; got {raw!r}")
    return factor


TIME_FACTOR = _time_factor()


def scaled(seconds: float) -> float:
    """A timeout or bound of the tests, stretched by ``$KVSTATE_TEST_TIME_FACTOR``."""
    return seconds * TIME_FACTOR


def is_mark(store: Store, key: str) -> bool:
    """A room's failure mark: intended state that outlives clear() (with its own TTL),
    not a participant's key left behind."""
    return store.keys.is_mark(key)


def keys_of(store: Store, pattern: str | None = None, marks: bool = False) -> list[str]:
    """The namespace's keys (matching ``pattern``); rooms' failure marks only with
    ``marks``: what a test counts as left behind is participant state."""
    found = store.scan(pattern or store.keys.all_pattern)
    return sorted(k for k in found if marks or not is_mark(store, k))


def room_keys(store: Store, room: int, marks: bool = False) -> list[str]:
    return keys_of(store, store.keys.room_prefix(room) + "*", marks)


def assert_every_key_has_ttl(store: Store) -> None:
    """Design rule 1, checked by scanning every key of the namespace (marks included)."""
    missing = []
    for key in keys_of(store, marks=True):
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
    """Poll ``pred`` until it holds or ``scaled(timeout)`` passes; its last answer."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
