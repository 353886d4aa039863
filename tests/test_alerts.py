"""docs/prometheus/kvstate-alerts.yml (issue 31): the alerts an operator needs (Redis
down, no monitor at all, leaks, stuck rooms) are there, every metric and label value
they name is one the monitor exports, and `promtool check rules` / `promtool test
rules` pass where promtool is installed (.ci/run installs it when it can)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstate.ops.findings import NAMES as FINDING_KINDS
from kvstate.ops.metrics import Metrics
from kvstate.ops.views import AGE_BUCKETS, Census
from kvstate.stats import TransferTotals

yaml = pytest.importorskip("yaml")

RULES = Path(__file__).resolve().parents[1] / "docs" / "prometheus" / "kvstate-alerts.yml"
RULE_TESTS = RULES.with_name("kvstate-alerts.test.yml")
# PromQL words that look like metric names but are not
PROMQL = {"absent", "sum", "by", "increase", "on", "or", "and", "rate", "without"}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _exported() -> tuple[set[str], str]:
    """The series names a monitor that swept once exports, and its scrape."""
    m = Metrics()
    m.set_census(Census.of([]))
    m.set_findings({})
    m.set_engines({})
    m.set_transfers({"prefill-0": TransferTotals()})
    m.observe_room([("transfer", 0.2)], failed=False)
    m.sweep_succeeded()
    text = m.render().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    return names, text


def test_the_alerts_an_operator_needs_are_there() -> None:
    rules = {r["alert"]: r for r in _rules()}
    assert rules["KvstateMonitorDown"]["expr"].strip() == "absent(kvstate_up)"
    assert rules["KvstateRedisDown"]["expr"].strip() == "kvstate_up == 0"
    assert "kvstate_participants_reaped_total" in rules["KvstateRoomsLeaking"]["expr"]
    assert 'kind="stuck"' in rules["KvstateRoomsStuck"]["expr"]
    for name, rule in rules.items():
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name


def test_every_metric_and_label_value_the_rules_name_is_exported() -> None:
    names, text = _exported()
    for rule in _rules():
        expr = rule["expr"]
        used = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?=[{\[)=<>!]|$|\s)", expr)) - PROMQL
        metrics = {u for u in used if u.startswith("kvstate_")}
        assert metrics, rule["alert"]
        for metric in metrics:
            assert metric in names, f"{rule['alert']}: {metric} is not exported"
        for label, value in re.findall(r'(\w+)!?="([^"]*)"', expr):
            known = {
                "kind": set(FINDING_KINDS),
                "age": {name for _, name in AGE_BUCKETS},
                "role": {"prefill", "decode"},
            }[label]
            assert value in known, f"{rule['alert']}: {label}={value!r} is never exported"
            assert f'{label}="{value}"' in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_and_unit_tests_pass() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None
    for args in (["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name]):
        done = subprocess.run(
            [promtool, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout
