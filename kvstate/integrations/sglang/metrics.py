"""The backend's own Prometheus series beside SGLang's ``sglang:kv_transfer_*``: rooms a
decode refused because the two sides cannot move KV between them (their shapes),
labelled by the prefill and this decode. Created on first use, in the scheduler process
that counts (SGLang's multiprocess collector exports it when metrics are on); no
prometheus_client, no series."""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_counter: Any = None


def _refusals() -> Any:
    global _counter
    with _lock:
        if _counter is None:
            try:
                from prometheus_client import Counter
            except ImportError:  # pragma: no cover - SGLang installs it
                _counter = False
            else:
                _counter = Counter(
                    "sglang:kv_transfer_refused",
                    "Rooms a decode refused: the prefill's KV cannot move here (kvstate)",
                    ["prefill", "decode"],
                )
        return _counter


def count_refusal(prefill: str, decode: str) -> None:
    counter = _refusals()
    if counter:
        counter.labels(prefill=prefill, decode=decode).inc()


def refusal_count(prefill: str, decode: str) -> float:
    """The counter's value for one pair (0 without prometheus_client)."""
    if not _refusals():
        return 0.0
    from prometheus_client import REGISTRY

    labels = {"prefill": prefill, "decode": decode}
    return float(REGISTRY.get_sample_value("sglang:kv_transfer_refused_total", labels) or 0.0)


__all__ = ["count_refusal", "refusal_count"]
