"""The audit's advice is what the tools do (issue 31 item 3): an operator who follows a
finding's `fix` hint, its detail, or `--fix`, ends with a clean audit and true messages
along the way. Real redis-server, the CLI through click's runner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import kvstate
from kvstate.cli import main
from kvstate.poll import KVPoll
from kvstate.store import Store

ADDR = "10.0.0.1:8998"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def audit_json(url: str, *args: str) -> dict[str, Any]:
    result = run("--url", url, "audit", "--json", *args)
    assert result.exit_code in (0, 1), result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


@pytest.fixture
def live_room(redis_url: str) -> Iterator[tuple[Store, str, str]]:
    """Room 13: a sender and a receiver in WaitingForInput, their engines alive."""
    store = kvstate.connect(redis_url)
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        snd, rcv = p.sender(13), d.receiver(13, ADDR)
        rcv.init(np.arange(8))
        assert snd.poll() == KVPoll.WaitingForInput
        yield store, snd.key, rcv.key
    store.close()


def test_wrong_type_key_the_advice_followed_ends_clean(
    live_room: tuple[Store, str, str], redis_url: str
) -> None:
    """A participant key that is no hash: the `fix` column said "--fix aborts its room"
    while --fix left it and the detail said "delete it, then kvstate abort ROOM"; after
    that DEL + abort, abort said the deleted participant "had already failed", and the
    room hash's listing of it was no finding at all."""
    store, tx, rx = live_room
    store.client.delete(tx)
    store.client.set(tx, "written by hand", px=600_000)

    table = run("--url", redis_url, "audit")
    assert table.exit_code == 1
    row = next(line for line in table.output.splitlines() if tx in line)
    assert "--fix leaves it" in table.output and "--fix aborts its room" not in row, table.output
    doc = audit_json(redis_url, "--fix")
    (finding,) = [f for f in doc["findings"] if f["key"] == tx]
    assert finding["kind"] == "corrupt" and not finding["fixed"]
    assert finding["hint"].startswith("--fix leaves it") and "kvstate abort 13" in finding["hint"]
    assert f"redis-cli DEL {tx}" in finding["left"]

    store.client.delete(tx)  # as advised, then abort
    result = run("--url", redis_url, "abort", "13")
    assert result.exit_code == 0, result.output
    assert "already failed" not in result.output, result.output
    assert "failed 1 of 1 participant(s) (rx:decode-b)" in result.output, result.output
    assert "listed but gone (no hash, nothing to fail): tx:prefill-a" in result.output
    assert store.client.hget(rx, "status") == b"Failed"

    # the listing of the deleted participant is a finding, and --fix removes it
    doc = audit_json(redis_url)
    stale = [f for f in doc["findings"] if f["kind"] == "stale_member"]
    assert [(f["side"], f["engine"], f["key"]) for f in stale] == [
        ("tx", "prefill-a", store.keys.room_hash(13))
    ], doc
    assert stale[0]["hint"] == "--fix removes the listing"
    shown = run("--url", redis_url, "show", "13")
    assert "`kvstate audit --fix` removes the listing" in shown.output, shown.output
    doc = audit_json(redis_url, "--fix")
    (fixed,) = [f for f in doc["findings"] if f["kind"] == "stale_member"]
    assert fixed["fixed"].startswith("removed tx:prefill-a from the room hash with 1 field"), fixed
    assert store.client.hexists(store.keys.room_hash(13), "tx:prefill-a") == 0
    assert store.client.hexists(store.keys.room_hash(13), "rx:decode-b") == 1  # untouched
    result = run("--url", redis_url, "audit", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["findings"] == []


def test_no_ttl_fix_names_where_the_ttl_came_from(redis_url: str) -> None:
    """A room none of whose keys has a TTL: --fix gives it --room-ttl, and said it gave
    "the room's remaining TTL"."""
    store = kvstate.connect(redis_url)
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        snd, rcv = p.sender(14), d.receiver(14, ADDR)
        rcv.init(np.arange(8))
        assert snd.poll() == KVPoll.WaitingForInput
        room_keys = sorted(store.scan(store.keys.room_prefix(14) + "*"))
        assert len(room_keys) == 3
        for key in room_keys:
            store.client.persist(key)
        doc = audit_json(redis_url, "--fix", "--room-ttl", "10m")
        fixes = {f["key"]: f["fixed"] for f in doc["findings"] if f["kind"] == "no_ttl"}
        assert sorted(fixes) == sorted(room_keys), doc
        # the first key fixed takes --room-ttl, and says so; the next ones then match it
        assert all(text.startswith("set a TTL of 10m (") for text in fixes.values()), fixes
        first = "set a TTL of 10m (--room-ttl: no key of the room has a TTL to match)"
        assert first in fixes.values(), fixes
        # a room with a TTL left on a key: that one is what the others get, and said so
        store.client.persist(snd.key)
        doc = audit_json(redis_url, "--fix")
        (one,) = [f for f in doc["findings"] if f["kind"] == "no_ttl"]
        assert one["fixed"].endswith("(the room's remaining TTL)"), one
    store.close()


def test_bad_status_finding_names_the_field_it_read(redis_url: str) -> None:
    """A participant that never changed status has no since_ms: its time is its
    created_ms, which the finding must name (it named since_ms)."""
    store = kvstate.connect(redis_url)
    with kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p:
        snd = p.sender(15)
        assert snd.poll() == KVPoll.Bootstrapping
        assert not store.client.hexists(snd.key, "since_ms")
        store.client.hset(snd.key, "status", "Bogus")
        doc = audit_json(redis_url)
        (f,) = [f for f in doc["findings"] if f["key"] == snd.key]
        assert f["kind"] == "corrupt"
        assert "'Bogus' / created_ms " in f["detail"] and "since_ms" not in f["detail"], f
        store.client.hset(snd.key, mapping={"since_ms": "later", "status": "Bogus"})
        doc = audit_json(redis_url)
        (f,) = [f for f in doc["findings"] if f["key"] == snd.key]
        assert "'Bogus' / since_ms 'later'" in f["detail"], f
        snd.abort("test over")
    store.close()
