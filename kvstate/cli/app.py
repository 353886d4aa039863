"""The ``kvstate`` command's plumbing: the click group, its context, exit codes, errors.

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

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import click
import redis
from redis.exceptions import NoPermissionError

from kvstate.connection import ENV_NAMESPACE, ENV_URL, Options, redact
from kvstate.defaults import ROOM_TTL
from kvstate.errors import KVStateError
from kvstate.ops.views import fmt_ms, holds_keys, namespaces
from kvstate.redis_server import RedisServerError
from kvstate.store import EMBEDDED, Store, connect

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
DEMO_RECORD = "kvstate-demo-*.json"  # written by a running `kvstate demo`, removed at exit

if TYPE_CHECKING:  # generic since click 8.2; a subscript would fail at run time on 8.1
    _ParamType = click.ParamType[float, Any]
else:
    _ParamType = click.ParamType


# --------------------------------------------------------------------------- plumbing


class Failure(click.ClickException):
    """One clear line on stderr, exit status 2."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"kvstate: error: {self.format_message()}", err=True)


class Duration(_ParamType):
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

    def store(
        self, need_url: bool = True, room_ttl: float = ROOM_TTL, patient: bool = False
    ) -> Store:
        """Connect. One-shot commands retry twice (an operator waits for an answer, and
        a wrong password is never going to work); ``patient`` ones (monitor) keep the
        engines' retry policy."""
        if need_url and not self.url:
            self._find_demo()
        options = None if patient else Options(retries=2, backoff_cap=0.2)
        try:  # no URL here only for `doctor`, which then asks for a private server
            return connect(self.url or EMBEDDED, self.namespace, room_ttl, options=options)
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
            raise Failure(scrub(describe(exc), obj.secrets if obj else [])) from None


def describe(exc: BaseException) -> str:
    if isinstance(exc, KVStateError):
        return str(exc)
    if isinstance(exc, NoPermissionError):
        return f"Redis refused a command under its ACL ({exc}); use a user with more rights"
    if isinstance(exc, redis.RedisError):
        return f"Redis error: {exc} (is the URL right and the server healthy?)"
    if isinstance(exc, RedisServerError):
        return f"embedded redis-server: {exc} (install redis-server or pass --url)"
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def opened(
    obj: Ctx, need_url: bool = True, room_ttl: float = ROOM_TTL, patient: bool = False
) -> Iterator[Store]:
    store = obj.store(need_url, room_ttl, patient)
    try:
        yield store
    finally:
        store.close()


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


def empty_json(store: Store, note: str) -> dict[str, Any]:
    return {
        "namespace": store.namespace,
        "namespace_empty": True,
        "note": note,
        "namespaces": namespaces(store)[0],
    }
