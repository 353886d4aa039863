"""`kvstate audit`: every leak kind planted by hand is named (exit 1); `--fix` repairs
what is safe (exit 0 after) and never touches a live room."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import kvstate
from kvstate import schema
from kvstate.cli import main
from kvstate.codec import TransferInfo
from kvstate.errors import CorruptStateError
from kvstate.ops.ledger import Entry, Ledger
from kvstate.poll import KVPoll
from kvstate.store import Store

ADDR = "10.0.0.1:8998"


def audit(url: str, *args: str) -> tuple[Result, dict[str, Any]]:
    result = CliRunner().invoke(main, ["--url", url, "audit", "--json", *args])
    assert result.exit_code in (0, 1), result.output
    return result, json.loads(result.stdout)


def kinds(doc: dict[str, Any]) -> list[str]:
    return sorted(f["kind"] for f in doc["findings"])


def create(store: Store, room: int, side: str, engine: str, **fields: Any) -> str:
    base: dict[str, Any] = {
        "addr": ADDR,
        "peers": 1,
        "timeouts_ms": "0 0",
    }
    store.execute([store.create(room, side, engine, {**base, **fields})])  # type: ignore[arg-type]
    return store.keys.participant(room, side, engine)  # type: ignore[arg-type]


def age_it(store: Store, key: str, seconds: float) -> None:
    """Pretend the participant entered its status ``seconds`` ago (server clock)."""
    now = store.server_time_ms()
    store.client.hset(
        key,
        mapping={"since_ms": now - int(seconds * 1000), "created_ms": now - int(seconds * 1000)},
    )


def plant_no_ttl(store: Store) -> str:
    key = store.keys.aborted(5)
    store.client.hset(key, "reason", "boom")
    return key


def plant_stuck(store: Store) -> str:
    key = create(store, 6, "tx", "prefill-a", timeouts_ms="1000 0")
    age_it(store, key, 5)
    return key


def plant_orphan_tracker(store: Store) -> str:
    tracker = store.keys.addr("10.9.9.9:1")
    gone = store.keys.tracker_member(8, "decode-gone")
    store.client.zadd(tracker, {gone: store.server_time_ms() + 60_000})
    store.client.pexpire(tracker, 60_000)
    return tracker


def plant_unclaimed_xfer(store: Store) -> str:
    """A transfer info whose sender and receiver are both gone: no clear takes it."""
    key = store.keys.room_hash(9)
    info = TransferInfo("decode-y", np.arange(4, dtype=np.int32))
    store.client.hset(key, schema.xfer_field("prefill-never", "decode-y"), info.encode())
    store.client.pexpire(key, 60_000)
    return key


def plant_dead_engine(store: Store) -> str:
    return create(store, 10, "rx", "decode-b", peer_addr=ADDR, **{"peer:prefill-dead": "inc1"})


def plant_restarted_engine(store: Store) -> str:
    key = create(store, 11, "rx", "decode-b", peer_addr=ADDR, **{"peer:prefill-r": "inc1"})
    engine = store.keys.engine("prefill-r")
    store.client.hset(engine, mapping={"role": "prefill", "incarnation": "inc2"})
    store.client.pexpire(engine, 60_000)
    return key


def plant_dead_owner(store: Store) -> str:
    """A sender whose prefill engine died (no registration): nobody will move it."""
    key = create(store, 14, "tx", "prefill-crashed")
    store.execute([store.update(14, "tx", "prefill-crashed", KVPoll.Transferring)])
    return key


def plant_unindexed(store: Store) -> str:
    """A participant its room hash no longer lists (abort cannot reach it)."""
    key = create(store, 15, "tx", "prefill-a")
    engine = store.keys.engine("prefill-a")  # its engine is alive
    store.client.hset(engine, mapping={"role": "prefill", "incarnation": "i1"})
    store.client.pexpire(engine, 60_000)
    store.client.hdel(store.keys.room_hash(15), "tx:prefill-a")
    return key


def corrupt_room(store: Store, room: int = 13) -> tuple[str, str]:
    """A room whose sender's status holds garbage, next to a healthy receiver."""
    tx = create(store, room, "tx", "prefill-a")
    rx = create(store, room, "rx", "decode-b")
    store.client.hset(tx, "status", "Weird")
    for engine, role in (("prefill-a", "prefill"), ("decode-b", "decode")):  # both alive
        store.client.hset(store.keys.engine(engine), mapping={"role": role, "incarnation": "i"})
        store.client.pexpire(store.keys.engine(engine), 60_000)
    return tx, rx


FIXABLE: dict[str, Callable[[Store], str]] = {
    "no_ttl": plant_no_ttl,
    "stuck": plant_stuck,
    "orphan_tracker": plant_orphan_tracker,
    "unclaimed_xfer": plant_unclaimed_xfer,
    "dead_engine": plant_dead_engine,
    "dead_engine/restarted": plant_restarted_engine,
    "dead_owner": plant_dead_owner,
    "unindexed": plant_unindexed,
    "corrupt": lambda store: corrupt_room(store)[0],
}


@pytest.mark.parametrize("kind", sorted(FIXABLE))
def test_fixable_leak_is_named_then_fixed(store: Store, state_url: str, kind: str) -> None:
    key = FIXABLE[kind](store)
    result, doc = audit(state_url, "--grace", "0")
    assert result.exit_code == 1
    found = [f for f in doc["findings"] if f["key"] == key]
    assert [f["kind"] for f in found] == [kind.split("/")[0]], doc
    assert found[0]["detail"]

    result, doc = audit(state_url, "--grace", "0", "--fix")
    assert result.exit_code == 0, doc
    fixed = [f for f in doc["findings"] if f["key"] == key]
    assert fixed[0]["fixed"], fixed
    assert doc["ledger"][0]["event"] == f"audit:{kind.split('/')[0]}"
    assert doc["ledger"][0]["key"] == key

    result, doc = audit(state_url, "--ledger", "0")
    assert result.exit_code == 0, doc
    assert doc["findings"] == []


def test_fixes_do_what_they_say(store: Store, state_url: str) -> None:
    keys = {kind: plant(store) for kind, plant in FIXABLE.items()}
    result, doc = audit(state_url, "--grace", "0", "--fix")
    assert result.exit_code == 0, doc
    c = store.client
    assert 0 < c.pttl(keys["no_ttl"]) <= 900_000
    for kind in ("stuck", "dead_engine", "dead_engine/restarted", "dead_owner"):
        assert c.hget(keys[kind], "status") == b"Failed"
        assert c.hget(keys[kind], "reason")
    assert b"bootstrap timeout" in c.hget(keys["stuck"], "reason")
    assert b"prefill-dead" in c.hget(keys["dead_engine"], "reason")
    assert b"lost its lease" in c.hget(keys["dead_owner"], "reason")
    assert store.members(15) == ["tx:prefill-a"]
    assert 0 < c.pttl(store.keys.room_hash(15)) <= 900_000
    assert c.exists(keys["orphan_tracker"]) == 0
    assert c.exists(keys["unclaimed_xfer"]) == 0
    events = {e.event for e in Ledger(store).recent(20)}
    assert {
        "audit:no_ttl",
        "audit:stuck",
        "audit:orphan_tracker",
        "audit:unclaimed_xfer",
        "audit:dead_engine",
    } <= events
    assert c.pttl(store.keys.ledger) > 6 * 24 * 3600 * 1000


def test_terminal_never_cleared_is_named_not_deleted(store: Store, state_url: str) -> None:
    key = create(store, 12, "tx", "prefill-a")
    store.execute([store.update(12, "tx", "prefill-a", KVPoll.Failed, "boom")])
    age_it(store, key, 120)
    result, doc = audit(state_url)
    assert result.exit_code == 1
    assert kinds(doc) == ["terminal_uncleared"]
    result, doc = audit(state_url, "--fix")
    assert result.exit_code == 1
    assert doc["findings"][0]["left"]
    assert store.client.exists(key) == 1
    # within the grace period it is not a finding
    result, doc = audit(state_url, "--grace", "10m")
    assert result.exit_code == 0


def test_info_of_a_live_receiver_is_normal(store: Store, state_url: str) -> None:
    """A receiver may publish before its sender exists: its own clear takes the info."""
    plant_unclaimed_xfer(store)
    create(store, 9, "rx", "decode-y")
    alive = store.keys.engine("decode-y")
    store.client.hset(alive, mapping={"role": "decode", "incarnation": "i"})
    store.client.pexpire(alive, 60_000)
    result, doc = audit(state_url)
    assert result.exit_code == 0, doc


def test_unclaimed_fields_are_named_on_every_run(redis_url: str) -> None:
    """Transfer infos and acks that no clear will take, each named by its field; the
    audit's reads change nothing."""
    store = kvstate.connect(redis_url)
    key = plant_unclaimed_xfer(store)
    store.client.hset(key, schema.ack_field("decode-z"), "prefill-a")
    for _ in range(2):
        result, doc = audit(redis_url)
        assert result.exit_code == 1
        found = [(f["kind"], f["key"], f["engine"]) for f in doc["findings"]]
        assert found == [
            ("unclaimed_xfer", key, "decode-z"),
            ("unclaimed_xfer", key, "prefill-never"),
        ]
    assert store.client.hlen(key) == 2
    result, doc = audit(redis_url, "--fix")
    assert result.exit_code == 0, doc
    assert store.client.exists(key) == 0  # its last field gone, the hash with it
    store.close()


def test_lfu_policy_is_named(redis_url: str) -> None:
    """Under an LFU policy the checks still run (none relies on idle times)."""
    store = kvstate.connect(redis_url)
    plant_unclaimed_xfer(store)
    store.client.config_set("maxmemory-policy", "allkeys-lfu")
    result, doc = audit(redis_url, "--grace", "0")
    assert result.exit_code == 1
    assert kinds(doc) == ["server_setting", "unclaimed_xfer"]
    store.close()


def test_live_rooms_are_clean_and_untouched(store: Store, state_url: str) -> None:
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        snd, rcv = p.sender(1), d.receiver(1, ADDR)
        rcv.init(np.arange(8))
        assert snd.poll() == KVPoll.WaitingForInput
        before = {k: store.client.hgetall(k) for k in (snd.key, rcv.key)}
        result, doc = audit(state_url, "--fix", "--grace", "0")
        assert result.exit_code == 0, doc
        assert {k: store.client.hgetall(k) for k in before} == before
        snd.clear()
        rcv.clear()


def test_corrupt_participant_advice_works_as_printed(store: Store, state_url: str) -> None:
    """The audit says `kvstate abort 13`; run as printed, it fails the room (garbage
    status included) and the audit is clean after. It used to exit 2 pointing back at
    `kvstate abort`, after writing the room's abort mark."""
    tx, rx = corrupt_room(store)
    result, doc = audit(state_url)
    assert result.exit_code == 1 and kinds(doc) == ["corrupt"], doc
    detail = doc["findings"][0]["detail"]
    command = re.search(r"kvstate abort \d+", detail)
    assert command is not None and command[0] == "kvstate abort 13", detail
    result = CliRunner().invoke(main, ["--url", state_url, *command[0].split()[1:]])
    assert result.exit_code == 0, result.output
    assert "failed 2 of 2" in result.output
    for key in (tx, rx):
        assert store.client.hget(key, "status") == b"Failed"
    result, doc = audit(state_url)
    assert result.exit_code == 0 and doc["findings"] == [], doc


def test_fix_aborts_the_room_of_a_corrupt_participant(store: Store, state_url: str) -> None:
    tx, rx = corrupt_room(store)
    result, doc = audit(state_url, "--fix")
    assert result.exit_code == 0, doc
    assert kinds(doc) == ["corrupt"] and "aborted room 13" in doc["findings"][0]["fixed"]
    assert store.client.hget(tx, "status") == store.client.hget(rx, "status") == b"Failed"
    assert b"corrupt" in store.client.hget(rx, "reason")
    result, doc = audit(state_url)
    assert result.exit_code == 0 and doc["findings"] == [], doc


def test_abort_writes_nothing_when_it_cannot_finish(store: Store, state_url: str) -> None:
    """A participant key that is not a hash: abort (the library's and the command's)
    refuses before writing anything, no abort mark, the other side untouched; the
    command and the audit name the way out (delete it, then abort)."""
    tx, rx = corrupt_room(store)
    store.client.delete(tx)
    store.client.set(tx, "written by hand", px=600_000)
    with pytest.raises(CorruptStateError):
        store.abort(13, "operator")
    assert store.client.exists(store.keys.aborted(13)) == 0
    assert store.client.hget(rx, "status") == b"Bootstrapping"
    result = CliRunner().invoke(main, ["--url", state_url, "abort", "13"])
    assert result.exit_code == 2 and f"redis-cli DEL {tx}" in result.output, result.output
    assert "nothing written" in result.output
    assert store.client.exists(store.keys.aborted(13)) == 0
    result, doc = audit(state_url, "--fix")
    assert result.exit_code == 1
    (finding,) = [f for f in doc["findings"] if f["key"] == tx]
    assert f"redis-cli DEL {tx}" in finding["left"], finding
    store.client.delete(tx)  # as advised
    result = CliRunner().invoke(main, ["--url", state_url, "abort", "13"])
    assert result.exit_code == 0, result.output
    assert store.client.hget(rx, "status") == b"Failed"


def test_one_fix_pass_leaves_nothing_for_a_second(store: Store, state_url: str) -> None:
    """A participant of a dead engine that also lost its TTL: one --fix repairs both (the
    missing TTL used to hide the dead owner until a second pass)."""
    key = plant_dead_owner(store)
    store.client.persist(key)
    result, doc = audit(state_url, "--fix")
    assert result.exit_code == 0, doc
    assert sorted((f["kind"], bool(f["fixed"])) for f in doc["findings"]) == [
        ("dead_owner", True),
        ("no_ttl", True),
    ], doc
    result, doc = audit(state_url, "--fix")
    assert result.exit_code == 0 and doc["findings"] == [], doc


def test_eviction_policy_is_a_finding(redis_url: str) -> None:
    s = kvstate.connect(redis_url)
    s.client.config_set("maxmemory-policy", "volatile-lru")
    result, doc = audit(redis_url, "--fix")
    assert result.exit_code == 1
    assert kinds(doc) == ["server_setting"]
    assert "volatile-lru" in doc["findings"][0]["detail"]
    s.close()


@pytest.mark.parametrize("denied", ["-config", "-config -info"])
def test_the_audit_needs_no_config(redis_url: str, redis_cli: Any, denied: str) -> None:
    """CONFIG GET reads every setting, requirepass included: the audit reads the
    eviction policy from INFO instead. Without CONFIG it checks everything; without
    INFO too, it notes the policy was not checked and goes on."""
    redis_cli(
        redis_url,
        "ACL",
        "SETUSER",
        "auditor",
        "on",
        ">audit-pw-123",
        "~*",
        "&*",
        "+@all",
        *denied.split(),
    )
    url = redis_url.replace("unix://", "unix://auditor:audit-pw-123@")
    store = kvstate.connect(redis_url)
    Ledger(store).append([Entry("test", None, "", "", "", None, "")])  # not empty
    store.client.config_set("maxmemory-policy", "allkeys-lru")
    store.close()
    result, doc = audit(url)
    assert "audit-pw-123" not in result.output
    if "-info" in denied:
        assert result.exit_code == 0, result.output
        assert any("INFO is not allowed" in n for n in doc["notes"]), doc["notes"]
    else:
        assert result.exit_code == 1 and kinds(doc) == ["server_setting"], doc
        assert doc["notes"] == [], doc["notes"]


def test_a_key_of_the_wrong_type_is_a_finding_not_a_crash(redis_url: str) -> None:
    store = kvstate.connect(redis_url)
    key = store.keys.participant(99, "tx", "ghost")
    store.client.set(key, "written by hand")
    store.client.expire(key, 600)
    ls = CliRunner().invoke(main, ["--url", redis_url, "ls", "--json"])
    assert ls.exit_code == 0, ls.output
    assert "wrong Redis type" in ls.output
    audit = CliRunner().invoke(main, ["--url", redis_url, "audit", "--json"])
    assert audit.exit_code == 1
    kinds = {f["kind"] for f in json.loads(audit.output)["findings"] if f["key"] == key}
    assert "corrupt" in kinds
    assert store.client.get(key) == b"written by hand"  # the audit changed nothing
    store.close()
