"""``kvstate doctor``: probe Redis (reachable, version, settings, ACL rights), UCX, GPUs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import click
from rich.table import Table

from kvstate.cli.app import Ctx, common, describe, main, opened, scrub
from kvstate.cli.output import console, cut, emit_json, styled
from kvstate.errors import KVStateError, PermissionDeniedError
from kvstate.ops.audit import acl_refused
from kvstate.ops.exits import EXIT_ERROR, EXIT_FINDINGS, EXIT_OK
from kvstate.ops.ledger import Ledger
from kvstate.ops.libraries import survey
from kvstate.ops.monitor import NOTIFY_SETTING
from kvstate.store import ENV_URL, LIBRARY_NAME, Store


@dataclass
class Check:
    name: str
    state: str  # ok | warn | fail | info
    detail: str


def _redis_checks(store: Store, checks: list[Check]) -> None:
    t0 = time.perf_counter()
    store.ping()
    checks.append(
        Check(
            "redis",
            "ok",
            f"{store.url} answers PING in "
            f"{(time.perf_counter() - t0) * 1000:.1f} ms "
            f"({'cluster' if store.cluster else 'standalone'})",
        )
    )
    for node in store.primaries():
        name = node if store.cluster else "server"
        checks.append(_version_check(store, node, name))
        checks += _setting_checks(store, node, name)
    _library_checks(store, checks)
    checks.append(_acl_check(store))


def _version_check(store: Store, node: str, name: str) -> Check:
    try:
        info = store.server_info(node)
    except PermissionDeniedError:
        return Check(f"version {name}", "warn", "INFO not allowed for this user")
    version = str(info.get("redis_version", "?"))
    major = int(version.split(".")[0]) if version[0].isdigit() else 0
    return Check(
        f"version {name}",
        "ok" if major >= 6 else "warn",
        f"Redis {version}" + ("" if major >= 7 else " (6.2 works; 7+ recommended)"),
    )


def _setting_checks(store: Store, node: str, name: str) -> list[Check]:
    """The server settings kvstate depends on: the eviction policy (INFO, a reader's
    command) and expiry events (CONFIG GET, an admin's: it reads every setting,
    ``requirepass`` included, so no user of docs/security.md may; the monitor finds out
    with a probe key instead)."""
    checks = []
    try:
        policy = store.eviction_policy(node)
    except PermissionDeniedError:
        policy = None
        checks.append(Check(f"maxmemory-policy {name}", "warn", "INFO not allowed for this user"))
    if policy is not None:
        ok = policy == "noeviction"
        checks.append(
            Check(
                f"maxmemory-policy {name}",
                "ok" if ok else "warn",
                policy + ("" if ok else ": set noeviction; anything else may evict room state"),
            )
        )
    try:
        flags = store.config_get(NOTIFY_SETTING, node)
    except KVStateError as exc:
        if not acl_refused(exc):
            raise
        checks.append(
            Check(
                f"{NOTIFY_SETTING} {name}",
                "info",
                "not read: CONFIG GET is an admin's (it reads every setting, passwords "
                "included); `kvstate monitor` tests expiry events with a probe key and "
                "says if they are off",
            )
        )
        return checks
    has = "E" in flags and ("x" in flags or "A" in flags)
    checks.append(
        Check(
            f"{NOTIFY_SETTING} {name}",
            "ok" if has else "info",
            (flags or "(off)")
            + (
                ""
                if has
                else "; `monitor` needs Ex: an admin runs CONFIG SET " + NOTIFY_SETTING + " Ex"
            ),
        )
    )
    return checks


def _library_checks(store: Store, checks: list[Check]) -> None:
    """kvstate's FUNCTION libraries on the server (Redis 7; issue 31): which kvstate
    version's each is, whether this one uses it, how many live engines do."""
    try:
        s = survey(store)
    except PermissionDeniedError:
        checks.append(
            Check(
                "functions",
                "warn",
                "FUNCTION LIST not allowed for this user: kvstate's libraries not listed "
                "(add +function|list on Redis 7)",
            )
        )
        return
    if s.no_function and not s.libraries:
        checks.append(Check("functions", "info", "no FUNCTION (Redis 6.2): scripts run by EVALSHA"))
        return
    if not any(lib.current for lib in s.libraries):
        checks.append(
            Check(
                "functions",
                "info",
                f"this kvstate's library {LIBRARY_NAME} is not loaded: engines run the "
                "scripts by EVALSHA (slower); an admin runs `kvstate functions load`",
            )
        )
    for lib in s.libraries:
        if lib.forged:
            state, what = (
                "fail",
                (
                    "holds code that is not kvstate's (engines do not run it: EVALSHA); look "
                    "at it, then `kvstate functions load --replace` as an admin"
                ),
            )
        elif lib.current:
            state, what = "ok", f"this kvstate's; used by {lib.engines} live engine(s)"
        elif lib.stale(s.unknown):
            state, what = "warn", "stale: no live engine uses it; `kvstate functions prune`"
        else:
            state, what = (
                "info",
                f"used by {lib.engines} live engine(s)"
                + (" (some engines unknown)" if s.unknown else ""),
            )
        where = f" {lib.node}" if store.cluster else ""
        checks.append(Check(f"function {lib.name}{where}", state, f"kvstate {lib.version}: {what}"))


# What `audit`, `monitor` and `doctor` need on top of the engine user's rights
# (docs/security.md): INFO (server checks), the ledger stream, expiry notifications and the
# monitor's probe key (SET with a TTL, EXISTS), the room traces (RPUSH, RPUSHX: `abort`;
# LRANGE and LLEN: `trace`), TYPE (the audit's check of each key's type) and ACL WHOAMI. No
# CONFIG: CONFIG GET reads every setting, `requirepass` and `masterauth` included, and
# CONFIG SET changes the server for every tenant; both are an admin's. Redis 6.2's ACL
# SETUSER knows no FUNCTION: on 7.x add OPERATOR_ACL_7's FCALL and FUNCTION LIST (the
# library, and doctor's list of them).
OPERATOR_ACL = (
    "ACL SETUSER kvstate-operator reset on >PASSWORD ~kvstate:NAMESPACE:* resetchannels "
    "&__keyevent@*__:expired -@all +ping +client|setname +time +scan +evalsha +eval "
    "+script|load +multi +exec +del +exists +pexpire +pttl +get +set +hget +hmget +hgetall "
    "+hset +hsetnx +hexists +hdel +hkeys +zadd +zrange +zrem +zremrangebyscore +info +xadd "
    "+xrevrange +rpush +rpushx +lrange +llen +type +subscribe +unsubscribe +acl|whoami"
)
OPERATOR_ACL_7 = OPERATOR_ACL + " +fcall +function|list"


# A read-only operator: `ls`, `show`, `top`, `engines`, `trace` and `audit` (without
# --fix) read with these plain read commands only (no script, no write, no CONFIG;
# tests/test_cli_operator.py runs them as this user). MULTI/EXEC group two reads; INFO
# and XREVRANGE are the audit's server and ledger checks, TYPE its check of each key's
# type; LRANGE and LLEN read a room's trace (its length: a long one is cut);
# FUNCTION LIST (7.x: READER_ACL_7) the audit's check of kvstate's libraries.
READER_ACL = (
    "ACL SETUSER kvstate-reader reset on >PASSWORD ~kvstate:NAMESPACE:* resetchannels "
    "-@all +ping +client|setname +time +scan +multi +exec +exists +pttl +get +hget +hmget "
    "+hgetall +hkeys +zrange +xrevrange +lrange +llen +type +info +acl|whoami"
)
READER_ACL_7 = READER_ACL + " +function|list"


def _acl_check(store: Store) -> Check:
    """Probe what kvstate does. Engines need SCAN and scripts (a poll of a missing room
    writes nothing): a refusal fails the check. The operator tools also read the
    ledger stream and server settings: a refusal there is a warning that
    says what degrades and gives the operator user's ACL line."""
    s = store
    engine_probes: list[tuple[str, Callable[[], object]]] = [
        ("SCAN", lambda: next(iter(s.scan(s.keys.all_pattern, count=10)), None)),
        ("scripts", lambda: s.execute([s.poll(0, "tx", "kvstate-doctor")])),  # FCALL/EVALSHA
    ]
    operator_probes: list[tuple[str, Callable[[], object]]] = [
        ("XREVRANGE", lambda: Ledger(s).recent(1)),
        ("INFO", lambda: s.server_info()),
        ("FUNCTION LIST", lambda: s.libraries()),  # None (no denial) on Redis 6.2
    ]

    def denied(probes: list[tuple[str, Callable[[], object]]]) -> list[str]:
        out = []
        for name, probe in probes:
            try:
                probe()
            except KVStateError as exc:
                if not acl_refused(exc):
                    raise
                out.append(name)
        return out

    engine_denied, operator_denied = denied(engine_probes), denied(operator_probes)
    user = s.whoami() or urlsplit(s.url).username or "default"
    if engine_denied:
        return Check(
            "acl",
            "fail",
            f"user {user}: denied {', '.join(engine_denied)}, which "
            "engines need; see the engine ACL line in kvstate's docs/security.md",
        )
    if operator_denied:
        return Check(
            "acl",
            "warn",
            f"user {user}: enough for engines; denied "
            f"{', '.join(operator_denied)}, so audit and monitor degrade (no ledger, "
            f"or server checks). For them use an operator user: {OPERATOR_ACL} (on "
            "Redis 7 add +fcall +function|list)",
        )
    return Check("acl", "ok", f"user {user}: SCAN, scripts, stream and INFO reads allowed")


def _ucx_checks(checks: list[Check]) -> None:
    try:
        import ucxx

        version = ".".join(str(v) for v in ucxx.get_ucx_version())
        checks.append(
            Check("ucx", "ok", f"ucxx {getattr(ucxx, '__version__', '?')}, UCX {version}")
        )
    except Exception as exc:  # a broken native library raises anything
        checks.append(
            Check(
                "ucx",
                "fail",
                f"ucxx not importable ({type(exc).__name__}: {exc}); pip install 'kvstate[ucx]'",
            )
        )
        return
    spec = importlib.util.find_spec("libucx")
    roots = list(spec.submodule_search_locations or []) if spec else []
    info = next(
        (Path(r) / "bin" / "ucx_info" for r in roots if (Path(r) / "bin" / "ucx_info").exists()),
        None,
    )
    if info is None:
        checks.append(Check("ucx transports", "info", "ucx_info not found; not listed"))
        return
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{info.parent.parent / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    try:
        proc = subprocess.run(
            [str(info), "-d"],
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        checks.append(Check("ucx transports", "info", f"ucx_info -d failed ({exc})"))
        return
    tls = sorted(set(re.findall(r"Transport:\s*(\S+)", proc.stdout)))
    rdma = any(t.startswith(("rc", "ud", "dc")) for t in tls)
    checks.append(
        Check(
            "ucx transports",
            "ok" if tls else "warn",
            (", ".join(tls) or "none found") + ("" if rdma else " (no RDMA transport seen)"),
        )
    )


def _gpu_checks(checks: list[Check]) -> None:
    from kvstate.gpu import gpu_facts

    gpus = gpu_facts()
    if not gpus:
        checks.append(Check("gpus", "info", "NVML sees no GPU (host memory transfers only)"))
    for g in gpus:
        checks.append(
            Check(
                f"gpu {g['index']}",
                "ok",
                f"{g['name']} {g['memory_total'] / 2**30:.0f} GiB, "
                f"{g['pci_bus_id']}, NVLinks up {g['nvlinks_up']}",
            )
        )


@main.command()
@common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--no-ucx", is_flag=True, help="Skip the UCX checks.")
@click.pass_obj
def doctor(obj: Ctx, as_json: bool, no_ucx: bool) -> None:
    """Check Redis (reachable, version, eviction policy, ACL rights), UCX and GPUs.
    Exit status 1 when a check fails, 2 when Redis cannot be checked at all (down, or
    the password refused), as for every command. Without a URL it tries the embedded
    server."""
    checks: list[Check] = []
    unreachable = False  # no Redis to check (down, or the password refused): exit 2
    if not obj.url:
        checks.append(
            Check(
                "url",
                "info",
                f"no --url / {ENV_URL}: using an embedded redis-server, as `demo` would",
            )
        )
    try:
        with opened(obj, need_url=False) as store:
            _redis_checks(store, checks)
    except KVStateError as exc:
        checks.append(Check("redis", "fail", scrub(describe(exc), obj.secrets)))
        unreachable = not any(c.name == "redis" and c.state == "ok" for c in checks)
    if not no_ucx:
        _ucx_checks(checks)
    _gpu_checks(checks)
    failed = any(c.state == "fail" for c in checks)
    if as_json:
        emit_json({"ok": not failed, "checks": [c.__dict__ for c in checks]})
    else:
        out = console()
        t = Table(box=None, header_style="bold")
        for name in ("check", "state", "detail"):
            t.add_column(name)
        style = {"ok": "green", "warn": "yellow", "fail": "red", "info": "blue"}
        for c in checks:
            t.add_row(cut(c.name), styled(c.state, style[c.state]), cut(c.detail, 1200))
        out.print(t)
    sys.exit(EXIT_ERROR if unreachable else EXIT_FINDINGS if failed else EXIT_OK)
