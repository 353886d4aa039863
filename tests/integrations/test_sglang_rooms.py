"""Holds (issue 29, item 6) on SGLang's own classes: a prefill's pages for a decode that
never comes, or stops holding the request, are freed at the bootstrap timeout (30 s by
default, configurable); a decode holding the request in its queue keeps them."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from kvstate.store import connect
from tests.helpers import keys_of, scaled

pytestmark = pytest.mark.sglang


def test_a_queued_decode_holds_the_prefill_pages_and_nobody_else_does(
    redis_url: str, tmp_path: Path
) -> None:
    from tests.integrations.sglang_rooms import BOOTSTRAP, holds

    proc = mp.get_context("spawn").Process(target=holds, args=(redis_url, str(tmp_path)))
    proc.start()
    proc.join(scaled(240))
    proc.kill()
    res = json.loads((tmp_path / "holds.json").read_text())
    assert res["bootstrap_timeout"] == BOOTSTRAP
    # Bootstrapping timeout on a room no decode joined
    assert "bootstrap timeout" in res["never_joined"], res
    # held for 4 timeouts: never Failed; the decode renewed its holds
    assert 0 not in res["held"] and res["holds"] >= 2, res
    assert res["after_hold"] == [4, 4] and res["bytes_equal"]
    assert "bootstrap timeout" in res["stopped"], res
    assert keys_of(connect(redis_url)) == []


def test_the_default_bootstrap_timeout_is_30_s_and_sglangs_setting_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstate.integrations.sglang import Settings

    monkeypatch.delenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", raising=False)
    monkeypatch.delenv("KVSTATE_SGLANG_BOOTSTRAP_TIMEOUT", raising=False)
    assert Settings.from_env().bootstrap_timeout == 30.0
    monkeypatch.setenv("KVSTATE_SGLANG_BOOTSTRAP_TIMEOUT", "12")
    assert Settings.from_env().bootstrap_timeout == 12.0
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "45")
    assert Settings.from_env().bootstrap_timeout == 45.0
