"""Small helpers shared by the state tests (not fixtures: plain functions).

Timing: every timeout and time bound in the tests goes through ``scaled()`` (and
``wait_for`` scales its own), stretched by ``$KVSTATE_TEST_TIME_FACTOR`` (default 1),
read once here, for slow or loaded hosts: ``KVSTATE_TEST_TIME_FACTOR=3 pytest``.
Durations that are the scenario itself (a lease, a timeout under test) are not scaled.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import redis

import kvstate
from kvstate.store import Store
from kvstate.testing import RedisProcess

PREFILL_ADDR = "10.0.0.1:8998"


def _time_factor() -> float:
    raw = os.environ.get("KVSTATE_TEST_TIME_FACTOR", "") or "1"
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not 0 < factor < float("inf"):
        raise ValueError(f"KVSTATE_TEST_TIME_FACTOR must be a number > 0, e.g. 2; got {raw!r}")
    return factor


TIME_FACTOR = _time_factor()


def scaled(seconds: float) -> float:
    """A timeout or bound of the tests, stretched by ``$KVSTATE_TEST_TIME_FACTOR``."""
    return seconds * TIME_FACTOR


def is_mark(store: Store, key: str) -> bool:
    """A room's failure mark: intended state that outlives clear() (with its own TTL),
    not a participant's key left behind."""
    return store.keys.is_mark(key)


def keys_of(
    store: Store, pattern: str | None = None, marks: bool = False, traces: bool = False
) -> list[str]:
    """The namespace's keys (matching ``pattern``): what a test counts as left behind is
    participant state, so rooms' failure marks come only with ``marks`` and room traces
    only with ``traces``. Both outlive ``clear()`` on purpose with a TTL of their own;
    each trace left out must have one (design rule 1)."""
    kept = []
    for key in sorted(store.scan(pattern or store.keys.all_pattern)):
        if not marks and is_mark(store, key):
            continue
        if not traces and store.keys.is_trace(key):
            assert store.client.pttl(key) != -1, f"trace {key} has no TTL"
            continue
        if not store.client.exists(key):  # expired since SCAN met it (the monitor's 1 ms
            continue  # probe on a busy Cluster node): it had a TTL, nothing left behind
        kept.append(key)
    return kept


def room_keys(store: Store, room: int, marks: bool = False) -> list[str]:
    return keys_of(store, store.keys.room_prefix(room) + "*", marks)


def assert_every_key_has_ttl(store: Store) -> None:
    """Design rule 1, checked by scanning every key of the namespace (marks and traces
    included)."""
    missing = []
    for key in keys_of(store, marks=True, traces=True):
        node = store.client
        pttl = node.pttl(key)
        if pttl == -1:  # -2: deleted since SCAN met it (a call running behind, a clear)
            missing.append((key, pttl))
    assert not missing, f"keys without TTL: {missing}"


def managers(store: Store, **kw: object) -> tuple[kvstate.KVManager, kvstate.KVManager]:
    p = kvstate.KVManager(store, "prefill", "prefill-a.tp0", PREFILL_ADDR, **kw)  # type: ignore[arg-type]
    d = kvstate.KVManager(store, "decode", "decode-b.tp0", "10.0.0.2:8998", **kw)  # type: ignore[arg-type]
    return p, d


def wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """Poll ``pred`` until it holds or ``scaled(timeout)`` passes; its last answer."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# --------------------------------------------------------------------------- shared by modules
# (moved from the test modules that other modules imported them from)


def snapshot(store: Store) -> dict[str, object]:
    """Every key's type and value, marks and traces included, to show a failed call
    changed nothing (design rule 7: not even a trace entry)."""
    c = store.client
    out: dict[str, object] = {}
    for key in keys_of(store, marks=True, traces=True):
        kind = c.type(key).decode()
        if kind == "hash":
            h = c.hgetall(key)
            out[key] = h
        elif kind == "set":
            out[key] = c.smembers(key)
        elif kind == "zset":
            out[key] = c.zrange(key, 0, -1)
        elif kind == "list":
            out[key] = c.lrange(key, 0, -1)
        else:
            out[key] = c.get(key) if kind == "string" else kind
    return out


# The least privilege an engine process (KVManager / KVSender / KVReceiver) needs, for
# namespace {ns} (password {password}). Found by running every engine path as a user
# with +@all and reading INFO commandstats (commands run inside the Lua scripts count:
# Redis 7 checks them against the caller's ACL too), then proven minimal by
# tests/test_security.py's test_engine_acl_is_minimal, which takes each command away
# in turn and watches the engine paths fail.
# - ping, client|setname: connection set-up (redis-py) and health checks
# - the scripts: on Redis 7, fcall and function|list (FCALL of kvstate's function
#   library, only once FUNCTION LIST ... WITHCODE showed its exact code: no tenant may
#   FUNCTION LOAD, which could replace or pre-load the code every namespace runs; an
#   admin loads it, `kvstate functions load`), and everywhere script|load, evalsha, and
#   eval after NOSCRIPT (server restart, failover, SCRIPT FLUSH): the EVAL path, taken
#   where the library is missing or not kvstate's code, and the whole way on 6.2.
#   Inside the scripts: exists, hset, hmget, hgetall, hkeys, hexists, hsetnx (the
#   failure mark), pexpire, zadd, zremrangebyscore, time; rpush and rpushx (a traced
#   room, its clear); publish (change notices; subscribe: the manager's own feed)
# - multi/exec/del/hset/pexpire: engine registration and clear(); hdel, zrem: clear()
# - hget/pexpire (lease renewal), scan/hgetall/pttl (find engines at an address),
#   hkeys (abort), zrange (dead-peer fan-out)
# The audit, monitor and doctor also need INFO, the ledger stream and keyspace
# notifications: give them their own user.
ENGINE_ACL = (
    "ACL SETUSER kvstate-engine reset on >{password} ~kvstate:{ns}:* resetchannels "
    "&kvstate:{ns}:changed:* -@all +ping +client|setname +time +scan +publish +subscribe "
    "+fcall +function|list +evalsha +eval +script|load "
    "+multi +exec +del +exists +pexpire +pttl "
    "+hget +hmget +hgetall +hset +hdel +hkeys +hexists +hsetnx "
    "+zadd +zrange +zrem +zremrangebyscore +rpush +rpushx"
)
# The FCALL path's two commands: without them (Redis 6.2, whose ACL SETUSER refuses
# +fcall; or a Redis 7 user kept off FUNCTION) every script runs by EVALSHA.
FCALL_ACL = ("fcall", "function|list")
ENGINE_ACL_EVAL = ENGINE_ACL.replace("+fcall +function|list ", "")
# The change notices' two commands (docs/design.md, "Change notices"): without them
# every path still runs, each step polling every waiting room (a notice is a hint).
NOTICE_ACL = ("publish", "subscribe")
ACL_PASSWORD = "engine-Pw_7"


def redis_major(client: redis.Redis) -> int:
    return int(str(client.info("server")["redis_version"]).split(".")[0])


def engine_acl(client: redis.Redis) -> str:
    """The engine line for the server ``client`` talks to: FCALL on 7+, EVAL on 6.2."""
    return ENGINE_ACL if redis_major(client) >= 7 else ENGINE_ACL_EVAL


def load_functions(*clients: redis.Redis) -> None:
    """The admin's step (`kvstate functions load`): this kvstate's FUNCTION library on
    each server that has FUNCTION (Redis >= 7), so that engine users, who may not load
    it, run the scripts by FCALL."""
    from kvstate.store import functions

    for c in clients:
        if redis_major(c) >= 7:
            try:
                c.execute_command("FUNCTION", "LOAD", functions.LIBRARY)
            except redis.ResponseError as exc:
                assert "already exists" in str(exc), exc


def flush_scripts(*clients: redis.Redis) -> None:
    """SCRIPT FLUSH, and FUNCTION FLUSH where there is one (Redis >= 7), on each: the
    next script calls meet NOSCRIPT or "Function not found"."""
    for c in clients:
        c.script_flush()
        if redis_major(c) >= 7:
            c.function_flush()


def setuser(admin: redis.Redis, line: str, ns: str, password: str = ACL_PASSWORD) -> None:
    admin.execute_command(*line.format(password=password, ns=ns).split())


def user_url(proc: RedisProcess, user: str = "kvstate-engine", password: str = ACL_PASSWORD) -> str:
    return f"redis://{user}:{quote(password, safe='')}@127.0.0.1:{proc.port}"


# ``kvstate demo`` in a subprocess: small pages and pools, so a run takes seconds.
DEMO_SMALL = ["--page-bytes", "4k", "--pool-pages", "256", "--pages-per-request", "1-32"]


def demo_command() -> list[str]:
    """The console script when the CLI is installed, else the module."""
    script = Path(sys.executable).with_name("kvstate")
    if script.exists():
        return [str(script), "demo"]
    return [sys.executable, "-m", "kvstate.demo"]


def demo_env(**extra: str) -> dict[str, str]:
    """A demo subprocess's environment: none of the caller's URL, namespace or authkey."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KVSTATE_REDIS_URL", "KVSTATE_NAMESPACE", "KVSTATE_DEMO_AUTHKEY")
    }
    env["COLUMNS"] = "120"
    env.update(extra)
    return env
