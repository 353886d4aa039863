"""The connector's settings, read once from ``kv_connector_extra_config`` (or the
environment), and the names both engines derive from vLLM's config: engine and rank
names, room ids."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstate.defaults import LEASE, WAITING_TIMEOUT
from kvstate.errors import VLLMConfigError
from kvstate.keys import MAX_ROOM

CONNECTOR = "KVStateConnector"
# seconds a prefill rank's send of one request may take before the room fails
TRANSFER_TIMEOUT = 60.0
# seconds a prefill rank holds a request's blocks for a decode that never publishes its
# pages (NixlConnector's kv_lease_duration is 30 s too); a decode holding the request in
# its queue keeps them longer (scheduler.py: Holds)
BOOTSTRAP_TIMEOUT = 30.0
_TIMES = {
    "lease": LEASE,
    "bootstrap_timeout": BOOTSTRAP_TIMEOUT,
    "waiting_timeout": WAITING_TIMEOUT,
    "transfer_timeout": TRANSFER_TIMEOUT,
}


@dataclass(frozen=True)
class Settings:
    """What ``kv_connector_extra_config`` may set; times in seconds on the Redis clock.

    ``bootstrap_timeout`` bounds how long a prefill rank holds a request's blocks for a
    decode that never publishes its pages (the decode engine died before it scheduled
    the request, or the router never sent it) and does not hold the request in its
    queue either (a decode renews its hold on queued requests every few seconds);
    ``waiting_timeout`` how long a room may
    wait between publish and transfer; ``lease`` how soon a dead peer engine's rooms
    fail (about twice the lease)."""

    redis_url: str | None = None
    namespace: str | None = None
    lease: float = LEASE
    bootstrap_timeout: float = BOOTSTRAP_TIMEOUT
    waiting_timeout: float = WAITING_TIMEOUT
    transfer_timeout: float = TRANSFER_TIMEOUT

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {"redis_url", "namespace", *_TIMES}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise VLLMConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown} for KVStateConnector; "
                f"it takes {sorted(known)}"
            )
        times: dict[str, float] = {}
        for name, default in _TIMES.items():
            value = extra.get(name, default)
            try:
                times[name] = float(value)
            except (TypeError, ValueError):
                times[name] = -1.0
            if not times[name] > 0:
                raise VLLMConfigError(
                    f"kv_connector_extra_config: {name} must be a number of seconds > 0, "
                    f"got {value!r}"
                )
        return cls(
            redis_url=extra.get("redis_url") or os.environ.get("KVSTATE_REDIS_URL"),
            namespace=extra.get("namespace") or os.environ.get("KVSTATE_NAMESPACE"),
            **times,
        )


def engine_name(engine_id: str) -> str:
    """A vLLM engine's kvstate address: its ranks register there."""
    return f"vllm@{engine_id}"


def rank_name(engine: str, rank: int, stage: int = 0, stages: int = 1) -> str:
    """One worker of an engine, TP rank ``rank`` of pipeline stage ``stage`` (of
    ``stages``): the kvstate engine (lease, participants) it runs."""
    return f"{engine}.tp{rank}" if stages == 1 else f"{engine}.pp{stage}.tp{rank}"


def new_nonce() -> str:
    """A per-request nonce: a request id used again (after an abort of the earlier
    request, or with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1) gets a new room, so the
    earlier room's failure mark is not its own. The system's random bytes, as
    ``secrets.token_hex`` reads them, without its frames: a prefill step makes one for
    every request it hands over."""
    return os.urandom(8).hex()


def room_of(engine_id: str, request_id: str, nonce: str = "") -> int:
    """The room of one request: derived from the prefill engine, its request id and the
    request's nonce, so that two requests never share one (a client cannot pick it)."""
    key = f"{engine_id}\0{request_id}\0{nonce}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % MAX_ROOM


__all__ = [
    "CONNECTOR",
    "Settings",
    "VLLMConfigError",
    "engine_name",
    "new_nonce",
    "rank_name",
    "room_of",
]
