"""docs/grafana/kvstate.json: every query names only metrics a real monitor exports (read
from its registry after a sweep of a real Redis), and the series docs/cli.md promises
are all charted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvstate
from kvstate.ops.audit import Auditor
from kvstate.ops.metrics import Metrics
from kvstate.ops.monitor import Monitor
from kvstate.stats import TransferRecorder

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvstate.json"
METRIC = re.compile(r"\b((?:kvstate|process|python)_[a-zA-Z0-9_]+)\b")
# What the issue asks the dashboard to show, as the metric families that carry it.
CHARTED = (
    "kvstate_up",
    "kvstate_participants",
    "kvstate_inflight_participants",
    "kvstate_rooms_reaped_total",
    "kvstate_audit_findings",
    "kvstate_engines_alive",
    "kvstate_transfer_bytes_total",
    "kvstate_transfer_seconds_bucket",
)
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def _queries(node: Any) -> Iterator[str]:
    """Every PromQL string in the dashboard: panel targets (rows included) and the
    template variables' queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            promql = key in ("expr", "definition") or (key == "query" and "(" in str(value))
            if promql and isinstance(value, str):
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def _exported(redis_url: str) -> set[str]:
    """The sample names a monitor's registry exports after one sweep of a real Redis
    that holds a participant, a registered engine and an engine's transfer counters."""
    store = kvstate.connect(redis_url)
    with kvstate.KVManager(store, "prefill", "prefill-a", "10.0.0.1:1") as p:
        p.sender(1).poll()
        recorder = TransferRecorder(store, "prefill-a")
        recorder.observe(4096, 0.002)
        recorder.flush()
        metrics = Metrics()
        auditor = Auditor(store)
        mon = Monitor(
            store, 0.1, metrics=metrics, audit=lambda: auditor.run().counts(), audit_interval=0
        )
        mon.sweep()
        mon._maybe_audit()
    store.close()
    names: set[str] = set()
    for family in metrics.registry.collect():
        names |= {s.name for s in family.samples}
        base = family.name
        names |= {base + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names


def test_every_query_names_a_metric_the_monitor_exports(redis_url: str) -> None:
    doc = json.loads(DASHBOARD.read_text())
    exported = _exported(redis_url)
    assert {"kvstate_up", "process_cpu_seconds_total"} <= exported
    queries = list(_queries(doc))
    assert len(queries) >= 10
    used: set[str] = set()
    for query in queries:
        names = set(METRIC.findall(query))
        assert names, f"a query that names no metric: {query}"
        assert names <= exported, f"{query}: not exported: {sorted(names - exported)}"
        used |= names
    missing = [name for name in CHARTED if name not in used]
    assert not missing, f"the dashboard charts nothing of {missing}"


def test_the_dashboard_is_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "kvstate" and doc["schemaVersion"] >= 36
    titles = [p["title"] for p in doc["panels"]]
    assert len(titles) == len(set(titles)), titles
    for panel in doc["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    assert all("$instance" in t["expr"] for p in doc["panels"] for t in p["targets"])
