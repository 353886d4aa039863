"""The connector's transfer statistics for vLLM's stats path, as NixlConnector reports
its own: each worker (and the scheduler, for its fallbacks) returns a
``KVStateConnectorStats`` from ``get_kv_connector_stats``; vLLM aggregates them over
the ranks, logs ``reduce()`` with its other stats and hands them to
``KVStatePromMetrics.observe`` for Prometheus:

- ``vllm:kvstate_xfer_time_seconds`` (histogram): one prefill worker's send of one
  request;
- ``vllm:kvstate_bytes_transferred`` (histogram): the bytes of that send;
- ``vllm:kvstate_num_failed_transfers``: sends and decode loads that failed;
- ``vllm:kvstate_num_kv_expired_reqs``: prefill blocks freed because no decode came;
- ``vllm:kvstate_num_recompute_fallbacks``: decode requests computed locally because
  the two engines cannot move KV between them (layout, model, TP sizes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

SERIES = ("transfer_duration", "bytes_transferred")
COUNTS = ("num_failed_transfers", "num_kv_expired_reqs", "num_recompute_fallbacks")
PREFIX = "vllm:kvstate_"


@dataclass
class KVStateConnectorStats(KVConnectorStats):
    """Observations since the last report: one entry per send in each series, a 1 per
    event in each count (lists, so that vLLM's aggregation over ranks is a concat)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float | int]] = {k: [] for k in (*SERIES, *COUNTS)}

    def record_transfer(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_duration"].append(seconds)
        self.data["bytes_transferred"].append(nbytes)

    def record(self, count: str) -> None:
        self.data[count].append(1)

    def clone_and_reset(self) -> KVStateConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        """Nothing observed (asked every step, by both sides: kept to one pass)."""
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's log line shows for the interval."""
        seconds = self.data["transfer_duration"]
        nbytes = sum(self.data["bytes_transferred"])
        out: dict[str, int | float] = {
            "Num successful transfers": len(seconds),
            "Avg xfer time (ms)": round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0,
            "MB transferred": round(nbytes / 2**20, 3),
        }
        out["Num failed transfers"] = len(self.data["num_failed_transfers"])
        out["Num KV expired reqs"] = len(self.data["num_kv_expired_reqs"])
        out["Num recompute fallbacks"] = len(self.data["num_recompute_fallbacks"])
        return out


class KVStatePromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvstate_*`` series, one per engine label set."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)  # type: ignore[no-any-return]

        self.xfer_time = per_engine(
            self._histogram_cls(
                name=f"{PREFIX}xfer_time_seconds",
                documentation="Seconds one prefill rank took to send one request's KV.",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
                labelnames=labelnames,
            )
        )
        self.nbytes = per_engine(
            self._histogram_cls(
                name=f"{PREFIX}bytes_transferred",
                documentation="Bytes one prefill rank sent for one request.",
                buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
                labelnames=labelnames,
            )
        )
        docs = {
            "num_failed_transfers": "Rooms that failed on a rank (a send or a load).",
            "num_kv_expired_reqs": "Prefill requests whose blocks were freed because no "
            "decode published its pages within bootstrap_timeout (nor held the request).",
            "num_recompute_fallbacks": "Decode requests computed locally because the "
            "prefill's KV cannot move to this engine (layout, model or TP sizes).",
        }
        self.counters = {
            k: per_engine(
                self._counter_cls(name=f"{PREFIX}{k}", documentation=doc, labelnames=labelnames)
            )
            for k, doc in docs.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("transfer_duration", ()):
            self.xfer_time[engine_idx].observe(seconds)
        for n in transfer_stats_data.get("bytes_transferred", ()):
            self.nbytes[engine_idx].observe(n)
        for k, counter in self.counters.items():
            if n := len(transfer_stats_data.get(k, ())):
                counter[engine_idx].inc(n)


__all__ = ["KVStateConnectorStats", "KVStatePromMetrics"]
