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


def keys_of(store: Store, pattern: str | None = None, traces: bool = False) -> list[str]:
    """Keys of the namespace (or matching ``pattern``). Room traces are left out unless
    ``traces``: they outlive ``clear()`` on purpose (kvstate.trace), so "no key left"
    means none but those, and each one left out must have a TTL (design rule 1)."""
    found = sorted(store.scan(pattern or store.keys.all_pattern))
    if traces:
        return found
    kept = []
    for key in found:
        parsed = store.keys.parse_room_key(key)
        if parsed is not None and parsed.kind == "trace":
            assert store.client.pttl(key) > 0, f"trace {key} has no TTL"
        else:
            kept.append(key)
    return kept


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
    """Poll ``pred`` until it holds or ``scaled(timeout)`` passes; its last answer."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
