"""The ``kvstate`` command: inspect rooms, abort them, audit leaks, keep the ledger.

Every subcommand that reads or writes room state needs ``--url`` (or
``$KVSTATE_REDIS_URL``), or a running ``kvstate demo`` to find: starting a private
embedded Redis to "inspect" it would show an empty, fresh server. ``--url`` and
``--namespace`` are taken before or after the subcommand.

Exit status, kept by every command (the README has the table): 0 ok; 1 findings or
nothing found (audit findings left, a failed doctor check, no such room, nothing
matched, a namespace without any kvstate key); 2 an error, printed as one line saying
what to do next. A password in the URL is never printed (design rule 8).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click
import redis
from redis.exceptions import NoPermissionError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvstate.connection import ENV_NAMESPACE, ENV_URL, Options, redact
from kvstate.errors import KVStateError
from kvstate.keys import parse_room_text
from kvstate.ops.audit import DEFAULT_GRACE, Auditor, acl_refused
from kvstate.ops.ledger import Entry, Ledger, Monitor, config_value
from kvstate.ops.metrics import Metrics
from kvstate.ops.views import (
    AGE_BUCKETS,
    STATUSES,
    Census,
    Participant,
    fmt_ms,
    holds_keys,
    info_json,
    namespaces,
    room_view,
    scan_participants,
)
from kvstate.poll import KVPoll
from kvstate.registry import EngineInfo, Registry
from kvstate.store import Store, connect
from kvstate.testing.servers import RedisServerError

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
DEMO_RECORD = "kvstate-demo-*.json"  # written by a running `kvstate demo`, removed at exit


# --------------------------------------------------------------------------- plumbing


class Failure(click.ClickException):
    """One clear line on stderr, exit status 2."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"kvstate: error: {self.format_message()}", err=True)


class Duration(click.ParamType):
    """``30s``, ``5m``, ``1h``, ``250ms``; a bare number is seconds. ``minimum`` (seconds)
    refuses periods that would hammer Redis (``--interval 0`` is a busy loop)."""

    name = "duration"

    def __init__(self, minimum: float = 0.0) -> None:
        self.minimum = minimum

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            seconds = float(value)
        else:
            m = _DURATION.match(str(value))
            if not m:
                self.fail(f"{value!r} is not a duration (examples: 30s, 5m, 1h, 250ms)", param, ctx)
            seconds = float(m[1]) * _UNITS[m[2]]
        if seconds < self.minimum:
            self.fail(
                f"{value!r} is too short: at least {fmt_ms(int(self.minimum * 1000))}", param, ctx
            )
        return seconds


DURATION = Duration()
PERIOD = Duration(minimum=0.1)


@dataclass
class Ctx:
    url: str | None = None
    namespace: str | None = "default"
    namespace_given: bool = False  # -n or $KVSTATE_NAMESPACE: a found demo's does not apply

    @property
    def secrets(self) -> list[str]:
        """The URL's password (as written and decoded), only to scrub it from errors."""
        if not self.url:
            return []
        try:
            pw = urlsplit(self.url).password
        except ValueError:
            return []
        return sorted({pw, unquote(pw)}, key=len, reverse=True) if pw else []

    def store(self, need_url: bool = True, room_ttl: float = 900.0, patient: bool = False) -> Store:
        """Connect. One-shot commands retry twice (an operator waits for an answer, and
        a wrong password is never going to work); ``patient`` ones (monitor) keep the
        engines' retry policy."""
        if need_url and not self.url:
            self._find_demo()
        options = None if patient else Options(retries=2, backoff_cap=0.2)
        try:
            return connect(self.url, self.namespace, room_ttl, options=options)
        except (ValueError, TypeError) as exc:  # redis-py reading the URL's query string
            if isinstance(exc, KVStateError):
                raise
            raise Failure(
                f"Redis URL {redact(self.url or '')} was refused ({exc}); check "
                "its query parameters (socket_timeout=SECONDS, ssl_ca_certs=PATH; "
                "a Cluster is redis+cluster://)"
            ) from None

    def _find_demo(self) -> None:
        """No URL given: use a running `kvstate demo`'s embedded server, if any."""
        record = running_demo()
        if record is None:
            raise Failure(
                f"no Redis URL: pass --url redis://HOST:PORT or set {ENV_URL}, or start "
                "`kvstate demo` (inspecting commands never start an embedded server; it "
                "would be empty)"
            )
        self.url = record["url"]
        if not self.namespace_given:
            self.namespace = record["namespace"]
        click.echo(
            f"kvstate: no --url given; using the running demo (pid {record['pid']}) "
            f"at {redact(self.url)}, namespace {self.namespace}",
            err=True,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_demo() -> dict[str, Any] | None:
    """The newest discovery record of a live `kvstate demo` of this user: a JSON file
    ``kvstate-demo-<pid>.json`` ({"url", "namespace", "pid"}) in ``$XDG_RUNTIME_DIR``
    (else /tmp). Files of other users are ignored (/tmp is shared)."""
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")  # where the demo writes it
    found: list[tuple[float, dict[str, Any]]] = []
    try:
        paths = list(folder.glob(DEMO_RECORD))
    except OSError:
        paths = []
    for path in paths:
        try:
            st = path.stat()
            if st.st_uid != os.getuid():
                continue
            doc = json.loads(path.read_text())
            pid = int(doc["pid"])
            record = {"url": str(doc["url"]), "namespace": str(doc["namespace"]), "pid": pid}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            found.append((st.st_mtime, record))
    return max(found, key=lambda f: f[0])[1] if found else None


def scrub(text: str, secrets: list[str]) -> str:
    """Belt and braces: no error text leaves with the password in it; one line."""
    for secret in secrets:
        text = text.replace(secret, "***")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = "; ".join(lines)
    return text if len(text) <= 600 else text[:597] + "..."


class KVGroup(click.Group):
    """Turns kvstate and redis-py errors into one line and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (KVStateError, redis.RedisError, RedisServerError, OSError) as exc:
            obj = ctx.find_object(Ctx)
            raise Failure(scrub(_describe(exc), obj.secrets if obj else [])) from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KVStateError):
        return str(exc)
    if isinstance(exc, NoPermissionError):
        return f"Redis refused a command under its ACL ({exc}); use a user with more rights"
    if isinstance(exc, redis.RedisError):
        return f"Redis error: {exc} (is the URL right and the server healthy?)"
    if isinstance(exc, RedisServerError):
        return f"embedded redis-server: {exc} (install redis-server or pass --url)"
    return f"{type(exc).__name__}: {exc}"


def console() -> Console:
    """Rich output on stdout; wide when piped so keys are not cut. Markup is off: engine
    names, reasons and URLs are printed as written (``[`` and ``]`` are legal in them);
    styles come from Text objects only."""
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return Console(width=width, highlight=False, soft_wrap=False, markup=False)


def styled(text: str, style: str) -> Text:
    return Text(text, style=style)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


@contextmanager
def opened(
    obj: Ctx, need_url: bool = True, room_ttl: float = 900.0, patient: bool = False
) -> Iterator[Store]:
    store = obj.store(need_url, room_ttl, patient)
    try:
        yield store
    finally:
        store.close()


def _status_style(status: str) -> str:
    return {
        "Failed": "red",
        "Success": "green",
        "Transferring": "cyan",
        "WaitingForInput": "yellow",
        "Bootstrapping": "yellow",
    }.get(status, "magenta")


# --------------------------------------------------------------------------- the group


_URL_HELP = (
    f"Redis URL: redis://, rediss://, unix://, redis+cluster:// [${ENV_URL}]; "
    "prefer the variable for a URL with a password (ps shows arguments)"
)
_NS_HELP = f"kvstate namespace [${ENV_NAMESPACE}; default: default]"


def _override(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    """Callback of a subcommand's --url / -n: what is given after the subcommand wins."""

    def set_it(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None:
            return
        obj = ctx.ensure_object(Ctx)  # the group's, or a fresh one for a lone subcommand
        setattr(obj, name, value or None)
        if name == "namespace":
            obj.namespace_given = True

    return set_it


def common(f: Callable[..., Any]) -> Callable[..., Any]:
    """--url and -n/--namespace on a subcommand too (rq-style: either place works)."""
    f = click.option(
        "--namespace",
        "-n",
        metavar="NS",
        expose_value=False,
        is_eager=True,
        callback=_override("namespace"),
        help=_NS_HELP,
    )(f)
    return click.option(
        "--url",
        metavar="URL",
        expose_value=False,
        is_eager=True,
        callback=_override("url"),
        help=_URL_HELP,
    )(f)


@click.group(
    cls=KVGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit status, for every command: 0 ok; 1 findings or nothing found (audit "
    "findings left, a failed doctor check, no such room, an empty "
    "namespace); 2 an error, printed as one line.",
)
@click.option("--url", metavar="URL", envvar=ENV_URL, help=_URL_HELP)
@click.option("--namespace", "-n", metavar="NS", envvar=ENV_NAMESPACE, help=_NS_HELP)
@click.version_option(package_name="kvstate")
@click.pass_context
def main(ctx: click.Context, url: str | None, namespace: str | None) -> None:
    """Inspect and repair kvstate room state in Redis."""
    ctx.obj = Ctx(url or None, namespace or "default", namespace_given=bool(namespace))


# --------------------------------------------------------------------------- empty namespaces


def empty_namespace_note(store: Store) -> str | None:
    """None when the namespace holds a kvstate key; else says so and names the
    namespaces that exist (a mistyped -n looks exactly like a healthy idle system)."""
    if holds_keys(store):
        return None
    names, partial = namespaces(store)
    others = ", ".join(names) + (", ..." if partial else "") if names else "none"
    return (
        f"namespace {store.namespace} holds no kvstate key (mistyped -n / "
        f"${ENV_NAMESPACE}?); namespaces in this Redis: {others}"
    )


def _empty_json(store: Store, note: str) -> dict[str, Any]:
    return {
        "namespace": store.namespace,
        "namespace_empty": True,
        "note": note,
        "namespaces": namespaces(store)[0],
    }


# --------------------------------------------------------------------------- show


def _name_width(names: Iterable[str]) -> int:
    """Room for whole engine names in narrow terminals (longer ones wrap, never cut)."""
    return min(20, max((len(n) for n in names), default=6))


def _participants_table(parts: list[Participant], with_room: bool) -> Table:
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    if with_room:
        t.add_column("room", justify="right")
    for name in ("side", "engine", "status", "age", "in status", "ttl", "reason / peers"):
        # names are never cut: "...tp0" and "...tp1" must not look the same at 80 columns
        t.add_column(
            name,
            overflow="fold" if name == "engine" else "ellipsis",
            min_width=_name_width(p.engine for p in parts) if name == "engine" else None,
        )
    for p in parts:
        extra = p.reason or ""
        if not extra and p.side == "rx":
            extra = f"peer {p.fields.get('peer_addr', '?')}: " + ", ".join(
                f"{e}@{inc}" for e, inc in sorted(p.bindings.items())
            )
        status = styled(p.status or "?", _status_style(p.status))
        row: list[str | Text] = [
            p.side,
            p.engine,
            status,
            fmt_ms(p.age_ms),
            fmt_ms(p.in_status_ms),
            fmt_ms(p.pttl_ms),
            extra,
        ]
        t.add_row(*([str(p.room)] if with_room else []), *row)
    return t


@main.command()
@common
@click.argument("room")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def show(obj: Ctx, room: str, as_json: bool) -> None:
    """Every participant of ROOM, its status, age, TTL, decoded transfer infos and abort
    mark. Exit status 1 when nothing is stored for the room."""
    r = parse_room_text(room)
    with opened(obj) as store:
        view = room_view(store, r)
    if as_json:
        emit_json(view.to_json())
        sys.exit(EXIT_FINDINGS if view.empty else EXIT_OK)
    out = console()
    if view.empty:
        out.print(
            f"room {r}: nothing stored (cleared, reaped by TTL, or never created) in "
            f"namespace {store.namespace}"
        )
        sys.exit(EXIT_FINDINGS)
    out.print(styled(f"room {r}", "bold"), f" namespace {store.namespace}  {store.url}")
    if view.aborted is not None:
        out.print(
            styled(
                f"aborted: {view.aborted} (mark expires in "
                f"{fmt_ms(view.aborted_ttl_ms)}; a participant joining before "
                "then starts Failed)",
                "red",
            )
        )
    if view.participants:
        out.print(_participants_table(view.participants, with_room=False))
    elif view.aborted is not None:
        out.print("no participants")
    for member in view.missing_members:
        out.print(styled(f"parts lists {member} but its participant hash is gone", "red"))
    for member in view.unindexed:
        out.print(
            styled(
                f"{member} is missing from the room's parts index: `kvstate abort` "
                "cannot reach it; `kvstate audit --fix` re-indexes it",
                "red",
            )
        )
    if view.infos:
        t = Table(title="transfer infos", title_justify="left", box=None, header_style="bold")
        for name in (
            "sender",
            "receiver",
            "pages",
            "runs",
            "first..last",
            "aux",
            "prefix",
            "dummy",
            "incarnation",
        ):
            t.add_column(name, overflow="fold" if name in ("sender", "receiver") else "ellipsis")
        for sender, per in sorted(view.infos.items()):
            for receiver, info in sorted(per.items()):
                if isinstance(info, str):
                    t.add_row(sender, receiver, styled(info, "red"))
                    continue
                j = info_json(info)
                t.add_row(
                    sender,
                    receiver,
                    str(j["pages"]),
                    str(j["runs"]),
                    f"{j['first_page']}..{j['last_page']}",
                    str(j["aux_index"]),
                    str(j["prefix_len"]),
                    str(j["dummy"]),
                    j["incarnation"] or "-",
                )
        out.print(t)
    for receiver, senders in sorted(view.acks.items()):
        out.print(f"acks for {receiver}: {', '.join(senders)}")


# --------------------------------------------------------------------------- ls


def _status_names(values: tuple[str, ...]) -> set[str]:
    """Status names from --status values: names in any case, or numbers."""
    by_lower = {name.lower(): name for name in KVPoll.__members__}
    names = set()
    for v in values:
        for part in (p.strip() for p in v.split(",")):
            if not part:
                continue
            if part.isascii() and part.isdigit():
                names.add(KVPoll.parse(int(part)).name)
            else:
                names.add(by_lower.get(part.lower()) or KVPoll.parse(part).name)
    return names


@main.command(name="ls")
@common
@click.option(
    "--status",
    "statuses",
    multiple=True,
    metavar="S",
    help="Only this status (name or number; repeat or comma-separate).",
)
@click.option("--side", type=click.Choice(["tx", "rx"]), help="Only senders or receivers.")
@click.option(
    "--older-than",
    type=DURATION,
    metavar="AGE",
    help="Only participants created at least AGE ago (30s, 5m...).",
)
@click.option("--engine", metavar="ENGINE", help="Only this engine's participants.")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def ls(
    obj: Ctx,
    statuses: tuple[str, ...],
    side: str | None,
    older_than: float | None,
    engine: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List participants (SCAN, never KEYS), oldest first. Exit status 1 when the
    namespace holds no kvstate key at all (a mistyped -n), 0 when none matches."""
    wanted = _status_names(statuses)
    min_age = None if older_than is None else int(older_than * 1000)
    with opened(obj) as store:
        found = [
            p
            for p in scan_participants(store)
            if (not wanted or p.status in wanted)
            and (side is None or p.side == side)
            and (engine is None or p.engine == engine)
            and (min_age is None or (p.age_ms or 0) >= min_age)
        ]
        note = None if found else empty_namespace_note(store)
        doc_empty = _empty_json(store, note) if note and as_json else {}
    found.sort(key=lambda p: (-(p.age_ms or 0), p.room, p.side, p.engine))
    shown = found[:limit]
    if as_json:
        emit_json({"count": len(found), "participants": [p.to_json() for p in shown], **doc_empty})
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
    out = console()
    if not found:
        out.print(note or "no participants match")
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
    out.print(_participants_table(shown, with_room=True))
    more = f" (showing {limit})" if len(found) > limit else ""
    out.print(f"{len(found)} participant(s){more}")


# --------------------------------------------------------------------------- top


def _census(store: Store) -> tuple[Census, dict[str, int], str | None]:
    census = Census.of(scan_participants(store))
    roles: dict[str, int] = {}
    for info in Registry(store).all():
        roles[info.role] = roles.get(info.role, 0) + 1
    note = empty_namespace_note(store) if not census.total and not roles else None
    return census, roles, note


def _top_view(
    store: Store,
    census: Census,
    roles: dict[str, int],
    note: str | None,
    trouble: str | None = None,
) -> Group:
    t = Table(title="participants by status", title_justify="left", box=None, header_style="bold")
    for name in ("status", "tx", "rx", "total"):
        t.add_column(name, justify="right" if name != "status" else "left")
    extra = sorted({st for _, st in census.by_status} - set(STATUSES))
    for st in (*STATUSES, *extra):
        tx, rx = census.by_status.get(("tx", st), 0), census.by_status.get(("rx", st), 0)
        t.add_row(styled(st, _status_style(st)), str(tx), str(rx), str(tx + rx))
    a = Table(title="in flight by age", title_justify="left", box=None, header_style="bold")
    for _, name in AGE_BUCKETS:
        a.add_column(name, justify="right")
    a.add_row(*(str(census.inflight_by_age.get(name, 0)) for _, name in AGE_BUCKETS))
    engines = ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) or "none"
    head = Text(
        f"kvstate top  {store.url}  namespace {store.namespace}  "
        f"{census.total} participant(s)  engines: {engines}"
    )
    lines: list[Any] = [head]
    if trouble:
        lines.append(styled(trouble, "red"))
    if note:
        lines.append(styled(note, "yellow"))
    return Group(*lines, t, a)


@main.command()
@common
@click.option("--once", is_flag=True, help="Print one snapshot and exit (for scripts).")
@click.option(
    "--interval",
    type=PERIOD,
    default=2.0,
    show_default=True,
    help="Refresh period (at least 100ms).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON.")
@click.pass_obj
def top(obj: Ctx, once: bool, interval: float, as_json: bool) -> None:
    """Live counts of participants by status and of in-flight ones by age. Live, it
    waits for Redis across a restart. --once / --json exit 1 when the namespace holds
    no kvstate key."""
    with opened(obj) as store:
        census, roles, note = _census(store)
        if as_json:
            extra = _empty_json(store, note) if note else {}
            emit_json({**census.to_json(), "engines": roles, **extra})
            sys.exit(EXIT_FINDINGS if note else EXIT_OK)
        out = console()
        if once:
            out.print(_top_view(store, census, roles, note))
            sys.exit(EXIT_FINDINGS if note else EXIT_OK)
        _live_top(store, out, interval, (census, roles, note))


def _live_top(
    store: Store, out: Console, interval: float, first: tuple[Census, dict[str, int], str | None]
) -> None:
    """Refresh until Ctrl-C or SIGTERM; a lost Redis is shown and waited for, not fatal
    (a restart or failover must not end the operator's view)."""
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last, lost_since = first, None
    try:
        with Live(_top_view(store, *last), console=out, auto_refresh=False) as live:
            while not stop.wait(interval):
                trouble = None
                try:
                    last = _census(store)
                    if lost_since is not None:
                        click.echo(
                            f"kvstate top: Redis at {store.url} is back after "
                            f"{time.monotonic() - lost_since:.1f}s",
                            err=True,
                        )
                        lost_since = None
                except KVStateError as exc:
                    if lost_since is None:
                        lost_since = time.monotonic()
                        click.echo(f"kvstate top: {exc}; waiting for it (Ctrl-C to stop)", err=True)
                    trouble = (
                        f"Redis unreachable for {time.monotonic() - lost_since:.0f}s "
                        "(showing the last counts); retrying"
                    )
                live.update(_top_view(store, *last, trouble=trouble), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- abort


@main.command()
@common
@click.argument("room")
@click.option(
    "--reason",
    default="aborted by operator (kvstate abort)",
    show_default=True,
    help="Failure reason both sides will see.",
)
@click.option(
    "--pre-emptive",
    "pre_emptive",
    is_flag=True,
    help="Mark a room that has no participant yet (a router cancelling a request "
    "before either side joined): whoever joins within the room TTL starts "
    "Failed. Without it, aborting an empty room is refused (exit 1).",
)
@click.pass_obj
def abort(obj: Ctx, room: str, reason: str, pre_emptive: bool) -> None:
    """Fail every participant of ROOM; each side sees Failed with REASON on its next
    poll, and a participant created later (within the room TTL) starts Failed. A room
    already aborted keeps its first reason. Exit status 1 when there is nothing to
    abort (finished and cleared, mistyped, or another namespace)."""
    r = parse_room_text(room)
    with opened(obj) as store:
        view = room_view(store, r)
        if view.aborted is not None:
            click.echo(
                f"room {r}: already aborted ({view.aborted}); left as is, mark "
                f"expires in {fmt_ms(view.aborted_ttl_ms)}"
            )
            return
        if not view.members and view.participants:
            raise Failure(
                f"room {r} has participants its parts index does not list; "
                "run `kvstate audit --fix` to re-index them, then abort again"
            )
        if not view.members and not pre_emptive:
            click.echo(
                f"room {r}: nothing to abort in namespace {store.namespace} (no "
                "participant: finished and cleared, reaped, mistyped, or another "
                "namespace); nothing written. To fail whoever joins later, pass "
                "--pre-emptive",
                err=True,
            )
            sys.exit(EXIT_FINDINGS)
        n = store.abort(r, reason)
    if not view.members:
        click.echo(
            f"room {r}: no participants yet; marked aborted, so either side that "
            f"joins within the room TTL starts Failed; reason: {reason}"
        )
        return
    if not n:
        click.echo(
            f"room {r}: its {len(view.members)} participant(s) had already failed "
            f"({', '.join(view.members)}); marked aborted; reason: {reason}"
        )
        return
    click.echo(
        f"room {r}: failed {n} of {len(view.members)} participant(s) "
        f"({', '.join(view.members)}); reason: {reason}"
    )


# --------------------------------------------------------------------------- engines


def _engine_json(e: EngineInfo) -> dict[str, Any]:
    return {
        "engine": e.engine,
        "role": e.role,
        "addr": e.addr,
        "incarnation": e.incarnation,
        "lease_left_ms": e.lease_left_ms,
        "endpoint_bytes": len(e.endpoint),
        "endpoint_kind": str(e.layout.get("transport", "none")) if e.endpoint else "none",
        "buffers": len(e.layout.get("buffers", []) or []),
        "host": e.host,
        "pid": e.pid,
        "gpus": e.gpus,
    }


@main.command()
@common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def engines(obj: Ctx, as_json: bool) -> None:
    """Registered engines: lease left, endpoint, incarnation, host, GPUs. Exit status 1
    when the namespace holds no kvstate key at all."""
    with opened(obj) as store:
        infos = Registry(store).all()
        note = None if infos else empty_namespace_note(store)
        extra = _empty_json(store, note) if note and as_json else {}
    docs = [_engine_json(e) for e in infos]
    if as_json:
        emit_json({"engines": docs, **extra})
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
    out = console()
    if not docs:
        out.print(note or "no engines registered (none holds a lease)")
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
    t = Table(box=None, header_style="bold")
    for name in (
        "engine",
        "role",
        "addr",
        "incarnation",
        "lease left",
        "endpoint",
        "host:pid",
        "gpus",
    ):
        t.add_column(
            name,
            overflow="fold" if name in ("engine", "addr") else "ellipsis",
            min_width=_name_width(d["engine"] for d in docs) if name == "engine" else None,
        )
    for d in docs:
        gpus = ", ".join(f"{g.get('index')}:{g.get('name')}" for g in d["gpus"]) or "-"
        t.add_row(
            d["engine"],
            d["role"],
            d["addr"],
            d["incarnation"],
            fmt_ms(d["lease_left_ms"]),
            f"{d['endpoint_kind']} ({d['endpoint_bytes']} B, {d['buffers']} buffers)",
            f"{d['host']}:{d['pid']}",
            gpus,
        )
    out.print(t)


# --------------------------------------------------------------------------- audit


@main.command()
@common
@click.option("--fix", is_flag=True, help="Repair what is safe to repair, and say what.")
@click.option(
    "--grace",
    type=DURATION,
    default=DEFAULT_GRACE,
    show_default=True,
    help="How long a terminal participant may wait for its clear, and unclaimed "
    "transfer infos for their sender.",
)
@click.option(
    "--room-ttl",
    type=DURATION,
    default=900.0,
    show_default=True,
    help="TTL --fix gives a key that has none when no key of its room has a TTL "
    "to match (otherwise it takes the room's remaining TTL).",
)
@click.option(
    "--ledger",
    "ledger_n",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Recent ledger entries to show.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def audit(obj: Ctx, fix: bool, grace: float, room_ttl: float, ledger_n: int, as_json: bool) -> None:
    """Find leaked or risky state. Exit status 0 when clean, 1 when anything is left
    unrepaired, or when the namespace holds no kvstate key at all."""
    with opened(obj, room_ttl=room_ttl) as store:
        report = Auditor(store, grace).run(fix=fix)
        recent = _recent_ledger(store, ledger_n, report.notes)
        empty = empty_namespace_note(store) if not report.scanned else None
        extra = _empty_json(store, empty) if empty and as_json else {}
    code = EXIT_FINDINGS if report.remaining or empty else EXIT_OK
    if as_json:
        emit_json({**report.to_json(), "ledger": [e.to_json() for e in recent], **extra})
        sys.exit(code)
    out = console()
    for note in report.notes:
        out.print(styled("note:", "yellow"), note)
    if report.findings:
        t = Table(box=None, header_style="bold")
        for name in ("kind", "key", "detail", "action" if fix else "fix"):
            t.add_column(name, overflow="fold")
        for f in report.findings:
            action = f.fixed or f.resolved or f.left or ("" if fix else _fix_hint(f.kind))
            t.add_row(
                styled(f.kind, "red" if f in report.remaining else "green"), f.key, f.detail, action
            )
        out.print(t)
    fixed = sum(1 for f in report.findings if f.fixed)
    resolved = sum(1 for f in report.findings if f.resolved)
    if empty:
        out.print(empty)
    elif not report.findings:
        out.print(f"clean: {report.scanned} key(s) checked in namespace {store.namespace}")
    else:
        out.print(
            f"{len(report.findings)} finding(s), {fixed} fixed, "
            + (f"{resolved} resolved meanwhile, " if resolved else "")
            + f"{len(report.remaining)} left ({report.scanned} key(s) checked)"
        )
    if recent:
        out.print(_ledger_table(recent))
    sys.exit(code)


def _recent_ledger(store: Store, n: int, notes: list[str]) -> list[Entry]:
    """The newest ledger entries; a user without stream rights gets a note instead."""
    if not n:
        return []
    try:
        return Ledger(store).recent(n)
    except KVStateError as exc:
        if not acl_refused(exc):
            raise
        notes.append(
            "XREVRANGE is not allowed for this user: the ledger is not shown (the "
            "README's operator ACL line allows it)"
        )
        return []


def _fix_hint(kind: str) -> str:
    return {
        "no_ttl": "--fix sets a TTL",
        "stuck": "--fix fails it",
        "orphan_tracker": "--fix ZREMs",
        "unclaimed_xfer": "--fix deletes",
        "dead_engine": "--fix fails it",
        "dead_owner": "--fix fails it",
        "unindexed": "--fix re-indexes it",
        "terminal_uncleared": "TTL reaps it; fix the owner's clear()",
        "corrupt": "inspect; kvstate abort",
        "server_setting": "CONFIG SET by an operator",
    }.get(kind, "")


def _ledger_table(entries: list[Entry]) -> Table:
    t = Table(title="ledger (newest first)", title_justify="left", box=None, header_style="bold")
    for name in ("id", "event", "room", "side", "engine", "last status", "age", "detail"):
        t.add_column(name)
    for e in entries:
        t.add_row(
            e.id,
            e.event,
            "" if e.room is None else str(e.room),
            e.side,
            e.engine,
            e.status,
            fmt_ms(e.age_ms),
            e.detail,
        )
    return t


# --------------------------------------------------------------------------- monitor


@main.command()
@common
@click.option(
    "--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus metrics on this port."
)
@click.option(
    "--metrics-addr", default="0.0.0.0", show_default=True, help="Address the metrics server binds."
)
@click.option(
    "--interval",
    type=PERIOD,
    default=5.0,
    show_default=True,
    help="Sweep period (at least 100ms); keep it well below the room TTL.",
)
@click.option(
    "--audit-interval",
    type=DURATION,
    default=60.0,
    show_default=True,
    help="How often the audit gauges are refreshed (0: every sweep).",
)
@click.option(
    "--grace",
    type=DURATION,
    default=DEFAULT_GRACE,
    show_default=True,
    help="Grace period for the audit gauges.",
)
@click.option(
    "--no-notify",
    is_flag=True,
    help="Never CONFIG SET notify-keyspace-events (use it only if already on).",
)
@click.option(
    "--duration", type=DURATION, help="Stop after this long (default: run until interrupted)."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per ledger entry.")
@click.pass_obj
def monitor(
    obj: Ctx,
    metrics_port: int | None,
    metrics_addr: str,
    interval: float,
    audit_interval: float,
    grace: float,
    no_notify: bool,
    duration: float | None,
    as_json: bool,
) -> None:
    """Keep the leak ledger (participants reaped by TTL, with their last status) and
    export Prometheus metrics."""
    with opened(obj, patient=True) as store:
        metrics = Metrics()
        auditor = Auditor(store, grace)

        def show_entry(e: Entry) -> None:
            if as_json:
                click.echo(json.dumps(e.to_json()))
            else:
                click.echo(
                    f"reaped by TTL: room {e.room} {e.side}:{e.engine}, last status "
                    f"{e.status}, age {fmt_ms(e.age_ms)} ({e.detail})"
                )

        mon = Monitor(
            store,
            interval,
            metrics=metrics,
            notifications=not no_notify,
            audit=lambda: auditor.run().counts(),
            audit_interval=audit_interval,
            on_entry=show_entry,
        )
        note = mon.start()
        server = None
        if metrics_port is not None:
            server = metrics.serve(metrics_port, metrics_addr)
            port = server.server_port if hasattr(server, "server_port") else metrics_port
            note += f"; metrics on http://{metrics_addr}:{port}/metrics"
        click.echo(
            f"monitoring namespace {store.namespace} at {store.url} every {interval:g}s: {note}",
            err=as_json,
        )
        stop = threading.Event()
        previous = None
        if threading.current_thread() is threading.main_thread():  # SIGTERM: finish the sweep
            previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            mon.run(stop, duration)
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if server is not None and hasattr(server, "shutdown"):
                server.shutdown()
        click.echo(f"monitor stopped after {mon.sweeps} sweep(s)", err=True)


# --------------------------------------------------------------------------- doctor


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
    for node, client in store.nodes():
        name = node if store.cluster else "server"
        try:
            info = client.info("server")
            version = str(info.get("redis_version", "?"))
            major = int(version.split(".")[0]) if version[0].isdigit() else 0
            checks.append(
                Check(
                    f"version {name}",
                    "ok" if major >= 6 else "warn",
                    f"Redis {version}" + ("" if major >= 7 else " (6.2 works; 7+ recommended)"),
                )
            )
        except NoPermissionError:
            checks.append(Check(f"version {name}", "warn", "INFO not allowed for this user"))
        for setting, good, why in (
            ("maxmemory-policy", "noeviction", "anything else may evict room state"),
            ("notify-keyspace-events", None, "`monitor` needs Ex (it sets it if allowed)"),
        ):
            try:
                value = config_value(client, setting)
            except NoPermissionError:
                checks.append(
                    Check(
                        f"{setting} {name}",
                        "warn",
                        "CONFIG GET not allowed: audit and monitor degrade",
                    )
                )
                continue
            if good is not None:
                ok = value == good
                checks.append(
                    Check(
                        f"{setting} {name}",
                        "ok" if ok else "warn",
                        value + ("" if ok else f": set {good}; {why}"),
                    )
                )
            else:
                has = "E" in value and ("x" in value or "A" in value)
                checks.append(
                    Check(
                        f"{setting} {name}",
                        "ok" if has else "info",
                        (value or "(off)") + ("" if has else f"; {why}"),
                    )
                )
    checks.append(_acl_check(store))


# What `audit`, `monitor` and `doctor` need on top of the engine user's rights (README,
# Security): INFO and CONFIG (server checks; CONFIG SET only to enable expiry events),
# OBJECT IDLETIME (unclaimed transfer infos), the ledger stream, expiry notifications,
# SMEMBERS (acks in `show`) and ACL WHOAMI.
OPERATOR_ACL = (
    "ACL SETUSER kvstate-operator reset on >PASSWORD ~kvstate:NAMESPACE:* resetchannels "
    "&__keyevent@*__:expired -@all +ping +client|setname +time +scan +evalsha +eval "
    "+script|load +multi +exec +del +exists +pexpire +pttl +get +set +hget +hmget +hgetall "
    "+hset +hdel +hkeys +hlen +hexists +sadd +scard +smembers +zadd +zrange +zrem "
    "+zremrangebyscore +info +config|get +config|set +object|idletime +xadd +xrevrange "
    "+subscribe +unsubscribe +acl|whoami"
)


def _acl_check(store: Store) -> Check:
    """Probe what kvstate does. Engines need SCAN and scripts (a poll of a missing room
    writes nothing): a refusal fails the check. The operator tools also read the
    ledger stream, idle times and server settings: a refusal there is a warning that
    says what degrades and gives the operator user's ACL line."""
    s = store
    engine_probes: list[tuple[str, Callable[[], object]]] = [
        ("SCAN", lambda: next(iter(s.scan(s.keys.all_pattern, count=10)), None)),
        ("EVALSHA", lambda: s.execute([s.poll(0, "tx", "kvstate-doctor")])),
    ]
    client = s.nodes()[0][1]
    operator_probes: list[tuple[str, Callable[[], object]]] = [
        ("XREVRANGE", lambda: Ledger(s).recent(1)),
        ("OBJECT IDLETIME", lambda: s.execute([s.command("OBJECT IDLETIME", s.keys.ledger)])),
        ("CONFIG GET", lambda: config_value(client, "maxmemory-policy")),
        ("INFO", lambda: client.info("server")),
    ]

    def denied(probes: list[tuple[str, Callable[[], object]]]) -> list[str]:
        out = []
        for name, probe in probes:
            try:
                probe()
            except (KVStateError, NoPermissionError) as exc:
                if not acl_refused(exc):
                    raise
                out.append(name)
        return out

    engine_denied, operator_denied = denied(engine_probes), denied(operator_probes)
    user = urlsplit(s.url).username or "default"
    try:
        raw = client.execute_command("ACL WHOAMI")
        user = raw.decode() if isinstance(raw, bytes) else str(raw)
    except redis.RedisError:
        pass
    if engine_denied:
        return Check(
            "acl",
            "fail",
            f"user {user}: denied {', '.join(engine_denied)}, which "
            "engines need; see the README's engine ACL line",
        )
    if operator_denied:
        return Check(
            "acl",
            "warn",
            f"user {user}: enough for engines; denied "
            f"{', '.join(operator_denied)}, so audit and monitor degrade (no ledger, "
            f"idle or server checks). For them use an operator user: {OPERATOR_ACL}",
        )
    return Check(
        "acl", "ok", f"user {user}: SCAN, EVALSHA, stream, idle-time and CONFIG reads allowed"
    )


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
                f"ucxx not importable ({type(exc).__name__}: {exc}); install ucxx-cu12",
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
    Exit status 1 when a check fails. Without a URL it tries the embedded server."""
    checks: list[Check] = []
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
    except (KVStateError, redis.RedisError, RedisServerError) as exc:
        checks.append(Check("redis", "fail", scrub(_describe(exc), obj.secrets)))
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
            t.add_row(c.name, styled(c.state, style[c.state]), c.detail)
        out.print(t)
    sys.exit(EXIT_FINDINGS if failed else EXIT_OK)


# --------------------------------------------------------------------------- demo


try:  # written by the demo's owner; the command appears once it exists
    from kvstate.demo import demo as _demo

    main.add_command(_demo)
except ImportError:  # pragma: no cover - until kvstate/demo.py lands
    pass
