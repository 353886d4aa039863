"""The `kvstate` command: show, ls, top, engines, abort, doctor, errors and secrets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import kvstate
from kvstate.cli import main
from kvstate.poll import KVPoll
from kvstate.store import Store
from kvstate.testing import RedisProcess
from tests.helpers import scaled

ADDR = "10.0.0.1:8998"
KVSTATE_BIN = Path(sys.executable).with_name("kvstate")


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def run_json(*args: str, code: int = 0) -> Any:
    result = run(*args)
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@pytest.fixture
def room(state_url: str) -> Iterator[tuple[Store, Any, Any]]:
    """Room 77: a sender and a receiver in WaitingForInput, 64 destination pages."""
    store = kvstate.connect(state_url)
    p = kvstate.KVManager(store, "prefill", "prefill-a.tp0", ADDR)
    d = kvstate.KVManager(store, "decode", "decode-b.tp0")
    snd, rcv = p.sender(77), d.receiver(77, ADDR)
    rcv.init(np.arange(10, 74), aux_index=3, prefix_len=5)
    assert snd.poll() == KVPoll.WaitingForInput
    yield store, snd, rcv
    p.close()
    d.close()
    store.close()


def test_show(room: tuple[Store, Any, Any], state_url: str) -> None:
    result = run("--url", state_url, "show", "77")
    assert result.exit_code == 0, result.output
    for text in (
        "room 77",
        "prefill-a.tp0",
        "decode-b.tp0",
        "WaitingForInput",
        "transfer infos",
        "10..73",
    ):
        assert text in result.output
    doc = run_json("--url", state_url, "show", "77", "--json")
    assert doc["members"] == ["rx:decode-b.tp0", "tx:prefill-a.tp0"]
    assert [(p["side"], p["status"]) for p in doc["participants"]] == [
        ("tx", "WaitingForInput"),
        ("rx", "WaitingForInput"),
    ]
    assert all(0 < p["ttl_ms"] <= 900_000 for p in doc["participants"])
    info = doc["transfer_infos"]["prefill-a.tp0"]["decode-b.tp0"]
    assert info["pages"] == 64 and info["runs"] == 1 and info["aux_index"] == 3
    assert info["prefix_len"] == 5


def test_show_missing_and_bad_rooms(redis_url: str) -> None:
    result = run("--url", redis_url, "show", "5")
    assert result.exit_code == 1 and "nothing stored" in result.output
    for bad in ("abc", "-1", str(2**63)):
        result = run("--url", redis_url, "show", "--", bad)
        assert result.exit_code == 2, result.output
        assert "room must be" in result.output
        assert "Traceback" not in result.output


def test_ls_filters(room: tuple[Store, Any, Any], state_url: str) -> None:
    store = room[0]
    with kvstate.KVManager(store, "prefill", "prefill-old", "10.0.0.5:1") as p:
        old = p.sender(78)
        old.poll()
        now = store.server_time_ms()
        store.client.hset(old.key, "created_ms", now - 120_000)

        def rows(*args: str) -> list[tuple[int, str, str]]:
            doc = run_json("--url", state_url, "ls", "--json", *args)  # 0 on no match too
            return sorted((r["room"], r["side"], r["status"]) for r in doc["participants"])

        assert len(rows()) == 3
        assert rows("--status", "Bootstrapping") == [(78, "tx", "Bootstrapping")]
        assert rows("--status", "waitingforinput,1") == [
            (77, "rx", "WaitingForInput"),
            (77, "tx", "WaitingForInput"),
            (78, "tx", "Bootstrapping"),
        ]
        assert rows("--side", "rx") == [(77, "rx", "WaitingForInput")]
        assert rows("--older-than", "1m") == [(78, "tx", "Bootstrapping")]
        assert rows("--older-than", "5m") == []
        assert rows("--side", "tx", "--status", "2") == [(77, "tx", "WaitingForInput")]
        table = run("--url", state_url, "ls", "--older-than", "30s")
        # created 2 minutes before the first listing; the table is read a moment later
        assert "prefill-old" in table.output and re.search(r"\b2m(\d{1,2}s?)?\b", table.output)
        bad = run("--url", state_url, "ls", "--status", "Nope")
        assert bad.exit_code == 2 and "unknown status" in bad.output
        bad = run("--url", state_url, "ls", "--older-than", "soon")
        assert bad.exit_code == 2 and "not a duration" in bad.output
        old.clear()


def test_show_finds_participants_the_index_lost(
    room: tuple[Store, Any, Any], state_url: str
) -> None:
    store = room[0]
    store.client.delete(store.keys.room_hash(77))
    doc = run_json("--url", state_url, "show", "77", "--json")
    assert sorted(doc["unindexed"]) == ["rx:decode-b.tp0", "tx:prefill-a.tp0"]
    assert "missing from the room hash" in run("--url", state_url, "show", "77").output
    result = run("--url", state_url, "abort", "77")
    assert result.exit_code == 2 and "audit --fix" in result.output
    assert run("--url", state_url, "audit", "--fix").exit_code == 0
    assert "failed 2 of 2" in run("--url", state_url, "abort", "77").output


def test_engines_and_top(room: tuple[Store, Any, Any], state_url: str) -> None:
    doc = run_json("--url", state_url, "engines", "--json")
    by_name = {e["engine"]: e for e in doc["engines"]}
    assert set(by_name) == {"prefill-a.tp0", "decode-b.tp0"}
    assert by_name["prefill-a.tp0"]["role"] == "prefill"
    assert by_name["prefill-a.tp0"]["addr"] == ADDR
    assert 0 < by_name["decode-b.tp0"]["lease_left_ms"] <= 10_000
    assert by_name["decode-b.tp0"]["incarnation"] == room[2].mgr.incarnation
    table = run("--url", state_url, "engines")
    assert "prefill-a.tp0" in table.output and "lease left" in table.output

    top = run("--url", state_url, "top", "--once")
    assert top.exit_code == 0, top.output
    assert "WaitingForInput" in top.output and "<10s" in top.output
    doc = run_json("--url", state_url, "top", "--json")
    assert doc["total"] == 2
    assert doc["by_status"] == {"rx:WaitingForInput": 1, "tx:WaitingForInput": 1}
    assert doc["inflight_by_age"]["<10s"] == 2
    assert doc["engines"] == {"decode": 1, "prefill": 1}


def test_abort_from_another_process(room: tuple[Store, Any, Any], state_url: str) -> None:
    """`kvstate abort` as a real process: both sides see Failed and the reason on
    their next poll."""
    store, snd, rcv = room
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_REDIS_URL"}
    proc = subprocess.run(
        [str(KVSTATE_BIN), "--url", state_url, "abort", "77", "--reason", "router gave up"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "failed 2 of 2" in proc.stdout
    # a second abort says so and keeps the first reason; show shows the mark
    again = run("abort", "77", "--reason", "second thoughts", "--url", state_url)
    assert again.exit_code == 0, again.output
    assert "already failed (router gave up)" in again.output
    shown = run("show", "77", "--url", state_url)
    assert shown.exit_code == 0 and "aborted: router gave up" in shown.output
    assert "participants: rx:decode-b.tp0, tx:prefill-a.tp0" in shown.output
    mark = json.loads(run("show", "77", "--json", "--url", state_url).stdout)["aborted"]
    assert mark["participants"] == ["rx:decode-b.tp0", "tx:prefill-a.tp0"]
    assert snd.poll() == KVPoll.Failed
    assert rcv.poll() == KVPoll.Failed
    assert snd.failure_exception().reason == "router gave up"
    assert rcv.failure_exception().reason == "router gave up"
    # the room is cleared now but its failure mark stays: an abort of it says so, one
    # of a mistyped room writes nothing
    kept = run("--url", state_url, "abort", "77")
    assert kept.exit_code == 0 and "already failed (router gave up)" in kept.output
    refused = run("--url", state_url, "abort", "7")
    assert refused.exit_code == 1, refused.output
    assert "nothing to abort" in refused.output and "--pre-emptive" in refused.output
    left = [k for k in store.scan(store.keys.all_pattern) if ":engines_at:" not in k]
    assert sorted(left) == sorted(  # the live engines' registrations and the mark
        [store.keys.aborted(77)] + [store.keys.engine(e) for e in ("decode-b.tp0", "prefill-a.tp0")]
    )
    # the same engine joining again once both cleared is a new request (a room id used
    # again): the mark goes (tests/test_reuse.py has the late joiners)
    reused = snd.mgr.sender(77)
    assert reused.poll() == KVPoll.Bootstrapping
    reused.clear()
    assert list(store.scan(store.keys.room_prefix(77) + "*")) == []
    # a router may abort before either side joined: whoever joins later starts Failed
    again = run("--url", state_url, "abort", "7", "--reason", "too late", "--pre-emptive")
    assert again.exit_code == 0 and "no participants yet" in again.output
    shown = run("--url", state_url, "show", "7", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["aborted"]["reason"] == "too late"
    late = snd.mgr.sender(7)
    assert late.poll() == KVPoll.Failed
    assert late.failure_exception().reason == "too late"


def test_doctor(redis_url: str) -> None:
    doc = run_json("--url", redis_url, "doctor", "--json")
    assert doc["ok"] is True
    checks = {c["name"].split(" ")[0]: c for c in doc["checks"]}
    assert checks["redis"]["state"] == "ok"
    assert checks["version"]["detail"].startswith("Redis ")
    assert checks["maxmemory-policy"]["state"] == "ok"
    assert checks["acl"]["state"] == "ok"
    assert checks["ucx"]["state"] in ("ok", "fail")
    assert "gpus" in checks or any(n.startswith("gpu") for n in checks)


def test_doctor_checks_every_primary(state_url: str) -> None:
    """Version and settings once per primary: "server" standalone, host:port on a
    Cluster (the Store names them)."""
    doc = run_json("--url", state_url, "doctor", "--json", "--no-ucx")
    assert doc["ok"] is True, doc
    store = kvstate.connect(state_url)
    try:
        primaries = store.primaries()
        names = {c["name"] for c in doc["checks"]}
        for node in primaries if store.cluster else ["server"]:
            assert {f"version {node}", f"maxmemory-policy {node}"} <= names, names
        assert store.config_get("maxmemory-policy", primaries[-1]) == "noeviction"
        assert store.server_info(primaries[-1])["redis_version"]
        assert store.whoami() == "default"
    finally:
        store.close()


def test_doctor_without_url_uses_an_embedded_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_REDIS_URL"}
    proc = subprocess.run(
        [str(KVSTATE_BIN), "doctor", "--json", "--no-ucx"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = [c["name"] for c in doc["checks"]]
    assert names[0] == "url" and "embedded" in doc["checks"][0]["detail"]
    assert doc["checks"][1]["name"] == "redis" and doc["checks"][1]["state"] == "ok"


def test_doctor_reports_unreachable_redis(tmp_path: Path) -> None:
    """The check table still prints; the exit status is every command's for an
    unreachable Redis (2), not a failed check's (1)."""
    result = run("--url", f"unix://{tmp_path}/nothing.sock", "doctor", "--no-ucx")
    assert result.exit_code == 2
    assert "cannot reach Redis" in result.output


def test_read_commands_need_a_url(tmp_path: Path) -> None:
    no_demo = {"XDG_RUNTIME_DIR": str(tmp_path)}  # no running demo's record to fall back on
    for args in (
        ["ls"],
        ["show", "1"],
        ["top", "--once"],
        ["engines"],
        ["audit"],
        ["abort", "1"],
        ["monitor", "--duration", "0"],
    ):
        result = run(*args, env=no_demo)
        assert result.exit_code == 2, (args, result.output)
        assert "no Redis URL" in result.output and "KVSTATE_REDIS_URL" in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_namespaces_are_separate(room: tuple[Store, Any, Any], state_url: str) -> None:
    doc = run_json("--url", state_url, "--namespace", "other", "ls", "--json", code=1)
    assert doc["count"] == 0 and doc["namespace_empty"] and doc["namespaces"] == ["default"]
    env_doc = CliRunner().invoke(
        main, ["--url", state_url, "ls", "--json"], env={"KVSTATE_NAMESPACE": "default"}
    )
    assert json.loads(env_doc.stdout)["count"] == 2
    bad = run("--url", state_url, "--namespace", "a b", "ls")
    assert bad.exit_code == 2 and "namespace must be" in bad.output


PASSWORD = "hunter2-Very-Secret-9f3a"


@pytest.fixture
def locked(redis_server_factory: Callable[..., RedisProcess]) -> RedisProcess:
    return redis_server_factory(password=PASSWORD, unix_socket=True, port="auto")


SUBCOMMANDS: list[list[str]] = [
    ["show", "1"],
    ["show", "1", "--json"],
    ["ls"],
    ["ls", "--json"],
    ["top", "--once"],
    ["top", "--json"],
    ["engines"],
    ["engines", "--json"],
    ["abort", "1"],
    ["audit"],
    ["audit", "--json", "--fix"],
    ["monitor", "--duration", "300ms", "--interval", "100ms"],
    ["doctor", "--no-ucx"],
    ["doctor", "--json", "--no-ucx"],
]


def test_password_never_printed(locked: RedisProcess) -> None:
    assert PASSWORD in locked.unix_url
    store = kvstate.connect(locked.unix_url)
    with kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p:
        p.sender(1).poll()
        wrong = locked.tcp_url.replace(PASSWORD, PASSWORD[::-1])
        for url in (locked.unix_url, locked.tcp_url, wrong):
            for args in SUBCOMMANDS:
                result = CliRunner().invoke(main, ["--url", url, *args])
                text = result.stdout + result.stderr
                assert PASSWORD not in text, (args, text)
                assert PASSWORD[::-1] not in text, (args, text)
                assert "Traceback" not in text
                if url is wrong:
                    assert result.exit_code in (1, 2), (args, text)
                    assert "authentication" in text or "auth" in text.lower(), (args, text)
        ok = CliRunner().invoke(main, ["--url", locked.unix_url, "ls"])
        assert "***" in CliRunner().invoke(main, ["--url", locked.unix_url, "top", "--once"]).output
        assert ok.exit_code == 0
    store.close()


def test_malformed_url_with_password() -> None:
    for url in (
        f"redis://:{PASSWORD}@host:notaport",
        f"http://:{PASSWORD}@host:1",
        f"redis://u:{PASSWORD}@/0",
    ):
        result = run("--url", url, "ls")
        assert result.exit_code == 2, result.output
        assert PASSWORD not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_password_never_printed_by_the_real_command(locked: RedisProcess) -> None:
    """Through $KVSTATE_REDIS_URL, as a real process, with a wrong password too."""
    store = kvstate.connect(locked.unix_url)
    mgr = kvstate.KVManager(store, "prefill", "prefill-a", ADDR)  # not an empty namespace
    for url, code in ((locked.unix_url, 0), (locked.unix_url.replace(PASSWORD, "nope"), 2)):
        env = {**os.environ, "KVSTATE_REDIS_URL": url}
        proc = subprocess.run(
            [str(KVSTATE_BIN), "top", "--once"],
            capture_output=True,
            text=True,
            timeout=scaled(60),
            env=env,
            check=False,
        )
        assert proc.returncode == code, proc.stderr
        assert PASSWORD not in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        if code == 2:
            assert proc.stderr.count("\n") == 1
            assert "authentication" in proc.stderr and "***" in proc.stderr
    mgr.close()
    store.close()
