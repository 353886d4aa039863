"""Security on real servers: a least-privilege ACL user, TLS, secrets kept out of every
output (design rule 8), and hostile input through the API on a Cluster too (rule 7;
tests/test_bad_input.py covers the standalone basics)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import redis

import kvstate
from kvstate import KVPoll
from kvstate.errors import (
    InvalidIndicesError,
    InvalidNameError,
    InvalidRoomError,
    KVStateError,
    StateConnectionError,
)
from kvstate.store import Store
from kvstate.store.connection import Options, redact
from kvstate.testing import RedisProcess, make_test_certs
from tests.helpers import (
    ACL_PASSWORD,
    ENGINE_ACL,
    ENGINE_ACL_EVAL,
    FCALL_ACL,
    NOTICE_ACL,
    PREFILL_ADDR,
    engine_acl,
    flush_scripts,
    keys_of,
    load_functions,
    redis_major,
    scaled,
    setuser,
    user_url,
    wait_for,
)

# --------------------------------------------------------------------------- ACL

# ENGINE_ACL (tests/helpers.py): the least privilege an engine process needs (Redis 7;
# ENGINE_ACL_EVAL on 6.2: engine_acl picks). On a Redis Cluster (set on every node: ACLs
# are per node), redis-py's Cluster client also reads the slot map and the command table.
CLUSTER_EXTRA = "+cluster|slots +command"


def engine_paths(url: str, *admins: redis.Redis, ns: str = "acl") -> None:
    """Every path an engine takes: connect, register, resolve peers by address and by
    name, publish, transfer, finish, poll_many, abort, a room id used again, dead-peer
    fan-out, a bootstrap timeout, NOSCRIPT recovery, heartbeats, clear, close."""
    # every room traced: the trace's RPUSH and RPUSHX are on the paths too
    store = kvstate.connect(url, namespace=ns, options=kvstate.Options(trace_rate=1.0))
    made: list[kvstate.KVManager] = []
    try:
        p = kvstate.KVManager(
            store,
            "prefill",
            "p0",
            PREFILL_ADDR,
            lease=1.0,
            heartbeat_interval=0.03,
            bootstrap_timeout=0.1,
        )
        made.append(p)
        d = kvstate.KVManager(
            store, "decode", "d0", "10.0.0.2:1", lease=1.0, heartbeat_interval=0.03
        )
        made.append(d)
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        assert rcv.init(np.arange(8), aux_index=1) == KVPoll.WaitingForInput
        assert snd.poll() == KVPoll.WaitingForInput
        assert snd.begin_transfer() == KVPoll.Transferring
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        assert d.poll_many([1, 2]) == {1: KVPoll.Success, 2: KVPoll.Failed}
        snd.clear()
        rcv.clear()
        flush_scripts(*admins)  # the next calls meet NOSCRIPT or "Function not found"
        s2 = p.sender(2)
        assert s2.poll() == KVPoll.Bootstrapping
        r2 = d.receiver(2, PREFILL_ADDR, senders=["p0"])
        r2.init([1])
        r2.abort("acl test")
        assert s2.poll() == KVPoll.Failed
        s2.clear()
        r2.clear()
        # room 2 used again once both cleared: a new request (create.lua's HEXISTS)
        s2 = p.sender(2)
        assert s2.poll() == KVPoll.Bootstrapping
        s2.clear()
        r3 = d.receiver(3, PREFILL_ADDR)
        r3.init([1])
        assert d.fail_peer(PREFILL_ADDR, "peer gone") == 1
        assert r3.poll() == KVPoll.Failed
        r3.clear()
        s4 = p.sender(4)
        s4.poll()
        # bootstrap timeout (0.1 s), on the server clock; heartbeats (every 0.03 s) run
        # meanwhile: lease renewal and peer checks under the ACL
        assert wait_for(lambda: s4.poll() == KVPoll.Failed, 5.0)
        assert "timeout" in s4.failure_exception().reason
        for m in (p, d):
            info = m.registry.get(m.engine)
            assert info is not None and info.incarnation == m.incarnation
            assert m.heartbeat.running
        # the heartbeat's peer check (HGET), in the foreground: a heartbeat only logs
        assert p.registry.incarnations([d.engine]) == {d.engine: d.incarnation}
        p.close()  # drops the lease: HGET, then DEL
        d.close()
        assert keys_of(store) == []
    finally:
        for m in made:
            m.close()
        store.close()


def engine_denials(admin: redis.Redis) -> list[dict]:
    """ACL LOG entries of the engine user. Before Redis 7.2 there is no CLIENT SETINFO,
    which redis-py sends on connect and whose refusal it ignores: not kvstate's. Nor is
    a refused FUNCTION LOAD a fault: an engine whose node lost the library tries to load
    it again, and docs/security.md's engine user may not (the library is an admin's)."""
    version = tuple(int(x) for x in admin.info("server")["redis_version"].split(".")[:2])
    return [
        e
        for e in admin.acl_log()
        if e.get("username") == "kvstate-engine"
        and not (version < (7, 2) and e.get("object") == "client")
        and e.get("object") != "function|load"
    ]


def fcalls(*admins: redis.Redis) -> int:
    """FCALLs run on these servers since their stats were reset."""
    return sum(int(a.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0)) for a in admins)


@pytest.fixture
def acl_server(redis_server_factory) -> tuple[RedisProcess, redis.Redis]:
    proc = redis_server_factory(port="auto")
    return proc, proc.client()


def test_engine_acl_runs_every_engine_path(acl_server) -> None:
    """With the library loaded by an admin (Redis 7), the engine user runs it by FCALL;
    once it is flushed, by EVAL (the user may not load it again)."""
    proc, admin = acl_server
    setuser(admin, engine_acl(admin), "acl")
    load_functions(admin)
    admin.acl_log_reset()
    admin.config_resetstat()
    engine_paths(user_url(proc), admin)
    denied = engine_denials(admin)
    assert denied == [], f"the engine user was refused something: {denied}"
    assert (fcalls(admin) > 0) == (redis_major(admin) >= 7)


def test_engine_acl_is_minimal(acl_server) -> None:
    """Without any one of its commands, some engine path fails, with StateConnectionError
    naming the ACL (a denial inside a Lua script included). The exceptions: MULTI,
    refused, lets the queued commands run on their own and only 'EXEC without MULTI'
    comes back (a KVStateError: Redis rejected ...); and on Redis 7 FCALL_ACL, without
    either of which every path still runs, by EVAL instead of FCALL."""
    proc, admin = acl_server
    kept: list[str] = []
    full = engine_acl(admin)
    for command in [w[1:] for w in full.split() if w.startswith("+")]:
        line = " ".join(w for w in full.split() if w != f"+{command}")
        admin.flushall()
        setuser(admin, line, "acl")
        if command != "script|load":  # (the EVAL path's SCRIPT LOAD is at connect, where
            load_functions(admin)  # the library is not there: Redis 6.2, or no admin step)
        admin.config_resetstat()
        try:
            engine_paths(user_url(proc), admin)
        except StateConnectionError as exc:
            text = str(exc)
            assert "refused a command under its ACL" in text, (command, text)
            assert ACL_PASSWORD not in text
            continue
        except KVStateError as exc:
            assert command == "multi" and "EXEC without MULTI" in str(exc), (command, exc)
            continue
        if command in FCALL_ACL:
            assert fcalls(admin) == 0, f"FCALL ran without +{command}"
            continue
        if command in NOTICE_ACL:  # a notice is a hint: refused, every path still runs
            denied = [str(d.get("object", "")) for d in engine_denials(admin)]
            assert command in denied, (command, denied)
            continue
        kept.append(command)
    assert kept == [], f"the engine paths work without {kept}: drop them from ENGINE_ACL"


def test_security_doc_gives_both_engine_lines() -> None:
    """docs/security.md's engine line is ENGINE_ACL; ENGINE_ACL_EVAL is the removal it
    states."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert ENGINE_ACL.format(password="PASSWORD", ns="NAMESPACE") in doc
    assert "leave out `+fcall +function|list`" in " ".join(doc.split())


def test_engine_acl_without_function_takes_the_eval_path(acl_server) -> None:
    """On Redis 7 a user kept off FUNCTION and FCALL (ENGINE_ACL_EVAL, or
    ``-function -fcall``) runs every engine path by EVALSHA/EVAL, even with the library
    loaded; the ACL LOG holds only the refused FUNCTION LIST that tells kvstate so (at
    connect, and with the EVAL after NOSCRIPT that probes whether FCALL works again)."""
    proc, admin = acl_server
    if redis_major(admin) < 7:
        pytest.skip("Redis 6.2 has no FUNCTION: every test here takes the EVAL path")
    setuser(admin, ENGINE_ACL_EVAL + " -function -fcall", "acl")
    load_functions(admin)
    admin.acl_log_reset()
    admin.config_resetstat()
    engine_paths(user_url(proc), admin)
    refused = {e.get("object") for e in admin.acl_log() if e.get("username") == "kvstate-engine"}
    assert refused <= {"function|load", "function|list", "client"}, refused
    stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] > 0 and "cmdstat_fcall" not in stats, stats


def test_engine_acl_confines_the_namespace(acl_server) -> None:
    """The engine user of namespace 'acl' can neither read nor write namespace 'other'
    (or anything outside kvstate:acl:*), through kvstate or directly."""
    proc, admin = acl_server
    setuser(admin, engine_acl(admin), "acl")
    # State of another tenant, written by the admin.
    owner = kvstate.connect(proc.tcp_url, namespace="other")
    om = kvstate.KVManager(owner, "prefill", "victim", PREFILL_ADDR)
    victim = om.sender(5)
    victim.poll()
    before = {
        k: owner.client.hgetall(k) for k in keys_of(owner) if ":engines_at:" not in k
    }  # hashes only; the address index is a zset

    url = user_url(proc)
    foreign = kvstate.connect(url, namespace="other")  # PING and SCRIPT LOAD are allowed
    attempts: dict[str, Callable[[], object]] = {
        "register": lambda: kvstate.KVManager(foreign, "prefill", "intruder"),
        "poll": lambda: foreign.execute([foreign.poll(5, "tx", "victim")]),
        "abort": lambda: foreign.abort(5, "hijack"),
        "clear": lambda: foreign.clear(5, "tx", "victim"),
        "batch": lambda: foreign.execute(
            [foreign.poll(5, "tx", "victim"), foreign.update(5, "tx", "victim", KVPoll.Failed)]
        ),
    }
    for name, attempt in attempts.items():
        with pytest.raises(StateConnectionError) as info:
            attempt()
        text = str(info.value)
        assert "refused a command under its ACL" in text, (name, text)
        assert "no permissions" in text, (name, text)
        assert "ACL SETUSER" in text and ACL_PASSWORD not in text
    # Outside kvstate: no other keys, no dangerous commands.
    raw = redis.Redis.from_url(url)
    for command in (
        ("GET", "somekey"),
        ("HGETALL", next(iter(before))),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "GET", "requirepass"),
        ("CONFIG", "SET", "maxmemory", "1mb"),
        ("SCRIPT", "FLUSH"),
        ("ACL", "WHOAMI"),
        ("ACL", "LIST"),
        ("SUBSCRIBE", "x"),
        ("SHUTDOWN",),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.execute_command(*command)
    # Inside a script the same ACL holds; a key passed in KEYS is checked before the
    # script runs. Redis 7's user runs functions (a library an admin loaded: it may not
    # load one itself, tests/test_tenants.py), 6.2's EVAL.
    flush_all, delete = "return redis.call('FLUSHALL')", "return redis.call('DEL', KEYS[1])"
    if redis_major(admin) >= 7:
        register = "redis.register_function('acl_{0}', function(KEYS) {1} end)"
        library = "\n".join(
            ["#!lua name=acl_test", register.format("a", flush_all), register.format("b", delete)]
        )
        admin.function_load(library)
        scripted = {flush_all: "acl_a", delete: "acl_b"}

        def run(body: str, *keys: str) -> object:
            return raw.fcall(scripted[body], len(keys), *keys)
    else:

        def run(body: str, *keys: str) -> object:
            return raw.eval(body, len(keys), *keys)

    with pytest.raises(redis.ResponseError, match="can't run this command"):
        run(flush_all)
    with pytest.raises(redis.exceptions.NoPermissionError):
        run(delete, next(iter(before)))
    if redis_major(admin) >= 7:
        admin.function_delete("acl_test")
    raw.close()
    assert {k: owner.client.hgetall(k) for k in keys_of(owner) if ":engines_at:" not in k} == before
    # The same user does its own namespace's work.
    own = kvstate.connect(url, namespace="acl")
    with kvstate.KVManager(own, "prefill", "p0") as mine:
        snd = mine.sender(5)
        assert snd.poll() == KVPoll.Bootstrapping
        snd.clear()
    own.close()
    foreign.close()
    victim.clear()
    om.close()
    owner.close()


@pytest.mark.cluster
def test_engine_acl_on_cluster(redis_cluster_url: str, redis_cluster) -> None:
    """The same line plus CLUSTER_EXTRA runs every engine path on a Cluster; without the
    extra, connect() is refused with a StateConnectionError naming the ACL."""
    admins = [redis_cluster.node_client(n) for n in redis_cluster.primaries()]
    port = redis_cluster_url.rsplit(":", 1)[1]
    url = f"redis+cluster://kvstate-engine:{ACL_PASSWORD}@127.0.0.1:{port}"
    try:
        for a in admins:
            setuser(a, engine_acl(a), "acl")
        with pytest.raises(StateConnectionError) as info:
            kvstate.connect(url, namespace="acl")
        assert "refused a command under its ACL" in str(info.value)
        assert ACL_PASSWORD not in str(info.value)
        for a in admins:
            setuser(a, engine_acl(a) + " " + CLUSTER_EXTRA, "acl")
            a.acl_log_reset()
        engine_paths(url, *admins)
        for a in admins:
            denied = engine_denials(a)
            assert denied == [], denied
    finally:
        for a in admins:
            a.acl_deluser("kvstate-engine")
            a.close()


@pytest.mark.parametrize("role", ["operator", "reader", "engine"])
def test_no_documented_user_reads_a_secret_or_changes_the_server(
    redis_server_factory, role: str
) -> None:
    """docs/security.md's operator, reader and engine lines (7.x's additions included) on a
    server with requirepass and masterauth set: none of them reads a setting (CONFIG
    GET: requirepass, masterauth, anything), the ACL users, or changes a server-wide
    parameter (CONFIG SET maxmemory / requirepass, CONFIG REWRITE, FUNCTION LOAD,
    FLUSHALL); and each still does its job (the operator and reader run their commands
    elsewhere: tests/test_cli_operator.py)."""
    from kvstate.cli import OPERATOR_ACL, OPERATOR_ACL_7, READER_ACL, READER_ACL_7

    root = "root-Pw_9"
    proc = redis_server_factory(port="auto", password=root)
    admin = proc.client()
    admin.config_set("masterauth", "primary-Pw_8")
    seven = redis_major(admin) >= 7
    line = {
        "operator": OPERATOR_ACL_7 if seven else OPERATOR_ACL,
        "reader": READER_ACL_7 if seven else READER_ACL,
        "engine": engine_acl(admin).format(password="PASSWORD", ns="NAMESPACE"),
    }[role]
    name = line.split()[2]
    setuser(admin, line.replace("PASSWORD", "{password}").replace("NAMESPACE", "{ns}"), "sec")
    user = redis.Redis(host="127.0.0.1", port=proc.port, username=name, password=ACL_PASSWORD)
    assert user.ping()
    for attempt in (
        ("CONFIG", "GET", "requirepass"),
        ("CONFIG", "GET", "masterauth"),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory", "1mb"),
        ("CONFIG", "SET", "requirepass", "owned"),
        ("CONFIG", "REWRITE"),
        ("CONFIG", "RESETSTAT"),
        ("ACL", "LIST"),
        ("ACL", "GETUSER", "default"),
        ("ACL", "USERS"),
        ("ACL", "SETUSER", "default", "nopass"),
        ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('x', function() end)"),
        ("FLUSHALL",),
    ):
        with pytest.raises(redis.ResponseError) as info:
            user.execute_command(*attempt)
        text = str(info.value).lower()
        assert "no permissions" in text or "unknown command" in text, (attempt, text)
        assert root not in text and "primary-pw_8" not in text
    assert admin.config_get("maxmemory")["maxmemory"] == "0"
    assert admin.config_get("requirepass")["requirepass"] == root
    user.close()
    admin.close()


# --------------------------------------------------------------------------- TLS


def tls_lifecycle(url: str) -> None:
    store = kvstate.connect(url, namespace="tls")
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1")
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        assert rcv.init(np.arange(16)) == KVPoll.WaitingForInput
        assert snd.poll() == KVPoll.WaitingForInput
        assert snd.transfer_infos()["d0"].kv_indices.tolist() == list(range(16))
        assert snd.begin_transfer() == KVPoll.Transferring
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
        snd.clear()
        rcv.clear()
    assert keys_of(store) == []
    store.close()


def test_tls_lifecycle_and_refusals(
    redis_tls_url: str, redis_tls_proc: RedisProcess, tmp_path: Path
) -> None:
    """rediss:// with ``?ssl_ca_certs=<ca.pem>`` (redis-py reads the query) runs a whole
    lifecycle; a certificate from another CA, no CA at all, or plain text to the TLS
    port each fail at connect() with a StateConnectionError, quickly."""
    assert redis_tls_url.startswith("rediss://") and "ssl_ca_certs=" in redis_tls_url
    tls_lifecycle(redis_tls_url)
    # The server really speaks TLS only on that port.
    port = redis_tls_proc.tls_port
    other = make_test_certs(tmp_path / "other-ca")
    bad = {
        "another CA": f"rediss://127.0.0.1:{port}?ssl_ca_certs={quote(str(other.ca_cert))}",
        "system CAs": f"rediss://127.0.0.1:{port}",
        "plain text": f"redis://127.0.0.1:{port}",
        "missing CA file": f"rediss://127.0.0.1:{port}?ssl_ca_certs={tmp_path}/none.pem",
    }
    took = {}
    # Short timeouts: plain text to a TLS port gets no answer (the server waits for the
    # rest of a "TLS record"), so only the socket timeout ends it.
    opts = Options(socket_timeout=1.0, connect_timeout=1.0, retries=1)
    for name, url in bad.items():
        t0 = time.monotonic()
        with pytest.raises(StateConnectionError) as info:
            kvstate.connect(url, namespace="tls", options=opts)
        took[name] = time.monotonic() - t0
        text = str(info.value)
        assert f"127.0.0.1:{port}" in text, text
        if name in ("another CA", "system CAs"):
            assert "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text
        assert took[name] < scaled(5.0), (name, took[name])
    print("\n[tls] refused after: " + ", ".join(f"{k}={v:.2f}s" for k, v in took.items()))


# --------------------------------------------------------------------------- secrets

SECRET = "Sup3r/S3cret:pw@x%y"  # every character that needs quoting in a URL
SECRET_FORMS = (SECRET, quote(SECRET, safe=""), quote(SECRET), "Sup3r", "S3cret")


def no_secret(text: str, where: str) -> None:
    for form in SECRET_FORMS:
        assert form not in text, f"{where} shows the password ({form!r}): {text[:500]}"


def exception_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + str(exc)


@pytest.mark.slow
def test_password_never_shown(
    redis_server_factory, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A lifecycle, failures, a dead server, the monitor's metrics and the CLI, all with a
    password URL (requirepass and an ACL user): the password appears in no log line at
    DEBUG (kvstate and redis-py), exception, traceback, repr, metric or CLI output."""
    caplog.set_level(logging.DEBUG)  # every logger: kvstate.*, redis.*
    proc = redis_server_factory(port="auto", password=SECRET)
    with proc.client() as admin:
        setuser(admin, engine_acl(admin), "sec", password=SECRET)
    urls = {
        "unix requirepass": proc.unix_url,
        "tcp requirepass": proc.tcp_url,
        "tcp acl user": user_url(proc, password=SECRET),
    }
    assert all(quote(SECRET, safe="") in u for u in urls.values())
    seen: list[tuple[str, str]] = []  # (where, text)

    for label, url in urls.items():
        store = kvstate.connect(url, namespace="sec")
        assert redact(url) == store.url and "***" in store.url
        p = kvstate.KVManager(
            store, "prefill", "p0", PREFILL_ADDR, lease=0.6, heartbeat_interval=0.05
        )
        d = kvstate.KVManager(
            store, "decode", "d0", "10.0.0.2:1", lease=0.6, heartbeat_interval=0.05
        )
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        rcv.init([1, 2, 3])
        snd.poll()
        rcv.abort("operator abort")
        err = snd.failure_exception()
        seen += [
            (f"{label} repr", repr(x))
            for x in (store, p, d, snd, rcv, store.client, store.client.connection_pool)
        ]
        seen.append((f"{label} KVTransferError", exception_text(err)))
        rcv.clear()
        # Wrong password, and an ACL refusal, through the same URL shapes.
        wrong = url.replace(quote(SECRET, safe=""), quote("Wr0ng/pw", safe=""))
        with pytest.raises(StateConnectionError) as info:
            kvstate.connect(wrong, namespace="sec")
        seen.append((f"{label} wrong password", exception_text(info.value)))
        if "acl" in label:
            foreign = kvstate.connect(url, namespace="other")
            with pytest.raises(StateConnectionError) as info:
                foreign.execute([foreign.poll(1, "tx", "p0")])
            seen.append((f"{label} NOPERM", exception_text(info.value)))
            foreign.close()
        p.close()
        d.close()
        store.close()

    # A dead server: calls fail, heartbeats log their warnings, then all recovers.
    store = kvstate.connect(urls["tcp requirepass"], namespace="sec")
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=0.6, heartbeat_interval=0.05)
    snd = p.sender(2)
    snd.poll()
    proc.kill()
    with pytest.raises(StateConnectionError) as info:
        snd.poll()
    seen.append(("dead server", exception_text(info.value)))
    assert wait_for(lambda: any("heartbeat of p0" in r.getMessage() for r in caplog.records), 5.0)
    proc.restart()
    with proc.client() as admin:
        setuser(admin, engine_acl(admin), "sec", password=SECRET)  # ACL users live in memory
    assert wait_for(lambda: p.registry.get("p0") is not None, 5.0)
    assert snd.poll() == KVPoll.Failed and "state lost" in snd.reason

    # Metrics from the monitor, over the same password URL.
    from kvstate.ops.metrics import Metrics
    from kvstate.ops.monitor import Monitor

    metrics = Metrics()
    monitor = Monitor(store, interval=0.1, metrics=metrics, notifications=True)
    seen.append(("monitor start", str(monitor.start())))
    monitor.sweep()
    seen.append(("metrics", metrics.render().decode()))
    monitor.events.close()

    # The CLI, given the URL by --url and by the environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    cli = [str(Path(sys.executable).with_name("kvstate"))]
    runs = [
        (["--url", urls["tcp requirepass"], "--namespace", "sec", "engines"], env),
        (
            ["--namespace", "sec", "ls", "--json"],
            {**env, "KVSTATE_REDIS_URL": urls["tcp acl user"]},
        ),
        (["--url", urls["tcp requirepass"], "--namespace", "sec", "show", "2"], env),
        (["--url", urls["tcp requirepass"], "doctor"], env),
        (["--url", urls["tcp requirepass"], "audit"], env),
        (
            ["--url", urls["tcp requirepass"].replace(quote(SECRET, safe=""), "nope"), "engines"],
            env,
        ),
        (["--url", f"redis://:{quote(SECRET, safe='')}@127.0.0.1:1", "engines"], env),
    ]
    codes = []
    for args, run_env in runs:
        done = subprocess.run(
            cli + args,
            capture_output=True,
            text=True,
            timeout=scaled(60),
            env=run_env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        codes.append(done.returncode)
        seen.append((f"cli {args[-1]}", done.stdout + done.stderr))
    assert codes[:2] == [0, 0] and codes[-1] != 0 and codes[-2] != 0, codes

    snd.clear()
    p.close()
    store.close()

    seen += [(f"log {r.name}", r.getMessage() + str(r.args)) for r in caplog.records]
    assert any(w.startswith("log kvstate") for w, _ in seen)  # we did capture kvstate logs
    for where, text in seen:
        no_secret(text, where)
    print(
        f"\n[secrets] checked {len(seen)} outputs, {len(caplog.records)} log records, "
        f"CLI exit codes {codes}"
    )


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def cstore(redis_cluster_url: str) -> Store:
    s = kvstate.connect(redis_cluster_url, namespace="hostile")
    yield s  # type: ignore[misc]
    s.close()


def snapshot(store: Store) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in keys_of(store):
        kind = store.client.type(key).decode()
        out[key] = (
            kind,
            store.client.pttl(key) > 0,
            store.client.hgetall(key) if kind == "hash" else None,
        )
    return out


ODD_NAMES = [
    "",
    " ",
    "a b",
    "a\nb",
    "a\rb",
    "tab\there",
    "nul\x00",
    "x{1}",
    "{}",
    "ns*",
    "ns?",
    "kvstate:*",
    "a,b",
    "é",
    "ß",
    "a" * 201,
    None,
    5,
    b"bytes",
]


@pytest.mark.cluster
@pytest.mark.parametrize(
    "ns",
    [n for n in ODD_NAMES if n is not None] + ["a" * 65, "a:b", "a/b", "a@b", "[ab", "../up"],
    ids=repr,
)
def test_odd_namespaces_on_cluster(redis_cluster_url: str, ns: object) -> None:
    with pytest.raises(InvalidNameError) as info:
        kvstate.connect(redis_cluster_url, namespace=ns)  # type: ignore[arg-type]
    assert "namespace" in str(info.value)


@pytest.mark.cluster
def test_odd_names_through_the_api_on_cluster(cstore: Store) -> None:
    """Engine ids, bootstrap addresses and sender lists with characters a key cannot
    carry (whitespace, braces that would change the hash slot, glob characters, NUL)
    are refused by name, and nothing is written."""
    with (
        kvstate.KVManager(cstore, "prefill", "p0", PREFILL_ADDR) as p,
        kvstate.KVManager(cstore, "decode", "d0", "10.0.0.2:1") as d,
    ):
        snd = p.sender(1)
        snd.poll()
        before = snapshot(cstore)
        for name in ODD_NAMES:
            with pytest.raises(InvalidNameError):
                kvstate.KVManager(cstore, "prefill", name)  # type: ignore[arg-type]
            if name:  # '' and None mean "same as the engine id"
                with pytest.raises(InvalidNameError):
                    kvstate.KVManager(cstore, "prefill", "ok", bootstrap_addr=name)  # type: ignore[arg-type]
            with pytest.raises(InvalidNameError):
                d.receiver(2, name)  # type: ignore[arg-type]
            with pytest.raises(InvalidNameError):
                d.receiver(2, PREFILL_ADDR, senders=["p0", name])  # type: ignore[list-item]
            with pytest.raises(InvalidNameError):
                d.fail_peer(name, "x")  # type: ignore[arg-type]
        for role in ("Prefill", "tx", "", None, "prefill "):
            with pytest.raises(ValueError):
                kvstate.KVManager(cstore, role, "ok")  # type: ignore[arg-type]
        assert snapshot(cstore) == before
        snd.clear()


BAD_ROOMS = [
    None,
    -1,
    -(2**63),
    1.5,
    2**63,
    2**64,
    2**200,
    "3",
    True,
    b"3",
    np.float64(3),
    [3],
    float("nan"),
]


@pytest.mark.cluster
def test_bad_rooms_on_cluster(cstore: Store) -> None:
    with (
        kvstate.KVManager(cstore, "prefill", "p0", PREFILL_ADDR) as p,
        kvstate.KVManager(cstore, "decode", "d0", "10.0.0.2:1") as d,
    ):
        snd = p.sender(2**63 - 1)  # the largest room is fine
        assert snd.poll() == KVPoll.Bootstrapping
        before = snapshot(cstore)
        for room in BAD_ROOMS:
            for call in (
                lambda r=room: p.sender(r),
                lambda r=room: d.receiver(r, PREFILL_ADDR),
                lambda r=room: p.poll_many([1, r]),
                lambda r=room: cstore.abort(r, "x"),
                lambda r=room: cstore.poll(r, "tx", "p0"),
                lambda r=room: cstore.clear(r, "tx", "p0"),
            ):
                with pytest.raises(InvalidRoomError):
                    call()
        assert snapshot(cstore) == before
        snd.clear()


@pytest.mark.cluster
def test_bad_indices_on_cluster(cstore: Store) -> None:
    """Page-index arrays that do not fit (over int32, negative, wrong dtype or shape),
    and aux/prefix values too large to store, are refused before anything is written."""
    bad_pages: list[object] = [
        np.array([2**31]),
        np.array([2**40]),
        np.array([2**63], dtype=np.uint64),
        [2**64],
        np.arange(2**31 - 2, 2**31 + 1),
        np.array([-1], dtype=np.int8),
        [1, -(2**31)],
        np.zeros((2, 2), dtype=np.int32),
        np.array([1.0]),
        np.array(["1"]),
        np.array([None]),
        5,
        "12",
        None,
    ]
    with (
        kvstate.KVManager(cstore, "prefill", "p0", PREFILL_ADDR) as p,
        kvstate.KVManager(cstore, "decode", "d0", "10.0.0.2:1") as d,
    ):
        snd = p.sender(3)
        rcv = d.receiver(3, PREFILL_ADDR)
        assert rcv.init([7, 8]) == KVPoll.WaitingForInput
        assert snd.poll() == KVPoll.WaitingForInput
        before = snapshot(cstore)
        for pages in bad_pages:
            with pytest.raises(InvalidIndicesError):
                rcv.init(pages)
            if pages is not None:  # no state indices at all is fine
                with pytest.raises(InvalidIndicesError):
                    rcv.init([1], state_indices=pages)
        for kw in (
            {"aux_index": -1},
            {"aux_index": 2**31},
            {"aux_index": 2**70},
            {"aux_index": True},
            {"aux_index": 1.0},
            {"prefix_len": -1},
            {"prefix_len": 2**63},
            {"prefix_len": 2**70},
            {"prefix_len": True},
            {"prefix_len": "5"},
        ):
            with pytest.raises(InvalidIndicesError):
                rcv.init([1], **kw)  # type: ignore[arg-type]
        for n in (-1, "3", 1.5, None):
            with pytest.raises(InvalidIndicesError):
                snd.init(n)  # type: ignore[arg-type]
        assert snapshot(cstore) == before
        with pytest.raises(InvalidIndicesError):
            snd.send([2**31])
        with pytest.raises(InvalidIndicesError):
            snd.send([-5])
        assert snapshot(cstore) == before  # a refused send moves no status either
        assert snd.transfer_infos()["d0"].kv_indices.tolist() == [7, 8]
        for part in (snd, rcv):
            part.clear()


def test_errors_share_one_base() -> None:
    for cls in (InvalidIndicesError, InvalidNameError, InvalidRoomError, StateConnectionError):
        assert issubclass(cls, KVStateError)
