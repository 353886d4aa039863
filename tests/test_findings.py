"""One table of finding kinds (kvstate.ops.findings): docs/cli.md shows exactly that table,
the metrics export exactly those kinds, the audit refuses any other, and the CLI hints
and the audit's "left" reasons come from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvstate.cli import main
from kvstate.ops.audit import Finding, Report
from kvstate.ops.findings import KINDS, NAMES, kind, readme_table
from kvstate.ops.metrics import Metrics
from kvstate.ops.repairs import Repairs

CLI_DOC = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
_HEADER = "| kind | found when | `--fix` |\n"


def _readme_findings() -> str:
    start = CLI_DOC.index(_HEADER)
    end = CLI_DOC.index("\n\n", start)
    return CLI_DOC[start : end + 1]


def test_the_readme_lists_every_kind_and_only_those() -> None:
    listed = re.findall(r"^\| `(\w+)` \|", _readme_findings(), re.M)
    assert listed == list(NAMES), "docs/cli.md's findings table and kvstate.ops.findings differ"
    assert CLI_DOC.count(_HEADER) == 1


def test_the_readme_table_is_the_one_in_the_code() -> None:
    """Descriptions drift too: docs/cli.md's rows are rendered from the table. After a
    change to KINDS, paste ``kvstate.ops.findings.readme_table()`` into docs/cli.md."""
    assert _readme_findings() == readme_table()


def test_each_kind_is_either_fixed_or_says_why_not() -> None:
    assert len(set(NAMES)) == len(NAMES)
    for k in KINDS:
        assert k.name.isidentifier() and k.check and k.hint, k
        assert bool(k.fix) != bool(k.left), f"{k.name}: give a fix or a reason to leave it"
        assert k.fixable == k.hint.startswith("--fix"), f"{k.name}: hint {k.hint!r}"
        assert "|" not in k.check + k.fix + k.left, "a | would split the table's row in docs/cli.md"


def test_the_metrics_export_exactly_the_table_kinds() -> None:
    m = Metrics()
    m.set_findings({})
    text = m.render().decode()
    exported = re.findall(r'^kvstate_audit_findings\{kind="(\w+)"\} 0\.0$', text, re.M)
    assert sorted(exported) == sorted(NAMES)
    assert Report().counts() == dict.fromkeys(NAMES, 0)


def test_an_unknown_kind_is_refused_with_the_place_to_add_it() -> None:
    with pytest.raises(KeyError, match="kvstate.ops.findings.KINDS"):
        Finding("leaky_bucket", "kvstate:default:x", "made up")
    assert kind("server_setting").left_for(None) == "needs an admin (server configuration)"


def test_the_cli_prints_the_table_hint_and_audit_fix_the_table_reason(redis_url: str) -> None:
    """(The server is flushed and its config put back before each test: conftest.)"""
    with redis.Redis.from_url(redis_url) as client:
        client.set("kvstate:default:stray", "1")  # no TTL, and no room: no_ttl alone
        result = CliRunner().invoke(main, ["--url", redis_url, "audit"])
        assert result.exit_code == 1, result.output
        assert "no_ttl" in result.output and kind("no_ttl").hint in result.output
        client.config_set("maxmemory-policy", "allkeys-lru")
        result = CliRunner().invoke(main, ["--url", redis_url, "audit", "--fix", "--json"])
    assert result.exit_code == 1, result.output  # the server setting is left
    by_kind = {f["kind"]: f for f in json.loads(result.stdout)["findings"]}
    assert by_kind["no_ttl"]["fixed"], by_kind
    assert by_kind["server_setting"]["left"] == kind("server_setting").left_for(None)


def test_every_fixable_kind_has_a_repair_and_no_other() -> None:
    """``audit --fix`` dispatches on the table: a kind marked fixable without an
    ``Repairs._fix_<kind>`` would crash the fix, a repair without the mark never runs."""
    repairs = {name.removeprefix("_fix_") for name in dir(Repairs) if name.startswith("_fix_")}
    repairs.discard("one")
    assert repairs == {k.name for k in KINDS if k.fixable}
