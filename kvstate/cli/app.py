"""The ``kvstate`` command's plumbing: the click group, its context, exit codes, errors.

Every subcommand that reads or writes room state needs ``--url`` (or
``$KVSTATE_REDIS_URL``), or a running ``kvstate demo`` to find: starting a private
embedded Redis to "inspect" it would show an empty, fresh server. ``--url`` and
``--namespace`` are taken before or after the subcommand.

Exit status, kept by every command (docs/cli.md has the table): 0 ok; 1 findings or
nothing found (audit findings left, a failed doctor check, no such room, nothing
matched, a namespace without any kvstate key); 2 an error, printed as one line saying
what to do next. A password in the URL is never printed (design rule 8).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click

from kvstate.cli.process import (
    CLI_URL_SOURCE,
    alive,
    log_warnings,
    pipe_closed,
    running_demo,
)
from kvstate.defaults import ROOM_TTL
from kvstate.errors import KVStateError, RedisServerError
from kvstate.ops.durations import Duration
from kvstate.ops.exits import (
    EXIT_FINDINGS,
    EXIT_OK,
    CommandError,
)
from kvstate.ops.views import holds_keys, namespaces
from kvstate.store import (
    EMBEDDED,
    ENV_NAMESPACE,
    ENV_PASSWORD,
    ENV_URL,
    URL_SOURCE,
    Options,
    Store,
    connect,
    redact,
)

# click >= 8.2 raises this for a group called without a command (8.1 prints the help)
_NO_ARGS: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())

# --------------------------------------------------------------------------- plumbing


DURATION = Duration()
PERIOD = Duration(minimum=0.1)


@dataclass
class Ctx:
    url: str | None = None
    namespace: str | None = "default"
    namespace_given: bool = False  # -n or $KVSTATE_NAMESPACE: a found demo's does not apply
    demo_pid: int | None = None  # the running demo whose embedded server is in use

    @property
    def secrets(self) -> list[str]:
        """The passwords in play (the URL's, as written and decoded, and
        $KVSTATE_REDIS_PASSWORD), only to scrub them from errors."""
        found = {os.environ.get(ENV_PASSWORD) or ""}
        try:
            pw = urlsplit(self.url or "").password
        except ValueError:
            pw = None
        if pw:
            found |= {pw, unquote(pw)}
        return sorted(found - {""}, key=len, reverse=True)

    def store(
        self, need_url: bool = True, room_ttl: float = ROOM_TTL, patient: bool = False
    ) -> Store:
        """Connect. One-shot commands retry twice (an operator waits for an answer, and
        a wrong password is never going to work); ``patient`` ones (monitor) keep the
        engines' retry policy. No SCRIPT LOAD: the views read with plain read commands
        (a read-only ACL user runs them), and a repair's script loads on first use."""
        if need_url and not self.url:
            self._find_demo()
        log_warnings()  # the library's, as one line each (not the demo's own logging)
        options = None if patient else Options(retries=2, backoff_cap=0.2)
        try:  # no URL here only for `doctor`, which then asks for a private server
            store = connect(
                self.url or EMBEDDED,
                self.namespace,
                room_ttl,
                options=options,
                preload_scripts=False,
            )
        except (ValueError, TypeError) as exc:  # redis-py reading the URL's query string
            if isinstance(exc, KVStateError):
                raise
            raise CommandError(
                f"Redis URL {redact(self.url or '')} was refused ({exc}); check "
                "its query parameters (socket_timeout=SECONDS, ssl_ca_certs=PATH; "
                "a Cluster is redis+cluster://)"
            ) from None
        return store  # a password the server ignores: connect() warned (as redis-cli does)

    def _find_demo(self) -> None:
        """No URL given: use a running `kvstate demo`'s embedded server, if any."""
        record = running_demo()
        if record is None:
            raise CommandError(
                f"no Redis URL: pass --url redis://HOST:PORT or set {ENV_URL}, or start "
                "`kvstate demo` (inspecting commands never start an embedded server; it "
                "would be empty)"
            )
        self.url = record["url"]
        self.demo_pid = record["pid"]
        if not self.namespace_given:
            self.namespace = record["namespace"]
        click.echo(
            f"kvstate: no --url given; using the running demo (pid {record['pid']}) "
            f"at {redact(self.url)}, namespace {self.namespace}",
            err=True,
        )

    def gone(self) -> str | None:
        """Why the Redis this command watches is gone for good (not restarting), if it
        is: the demo that ran its embedded server exited, or the directory of its unix
        socket was removed (an embedded server's, at its exit). None: it may come back."""
        if self.demo_pid is not None and not alive(self.demo_pid):
            return (
                f"the kvstate demo (pid {self.demo_pid}) that ran this embedded Redis has "
                "exited, and its server with it; start another demo, or pass --url"
            )
        try:
            parts = urlsplit(self.url or "")
        except ValueError:
            return None
        if parts.scheme == "unix" and parts.path and not Path(parts.path).parent.is_dir():
            return (
                f"the directory of the unix socket {parts.path} is gone (an embedded "
                "server's, removed at its exit): that Redis will not come back; pass "
                "the --url of a running one"
            )
        return None


def scrub(text: str, secrets: list[str]) -> str:
    """Belt and braces: no error text leaves with the password in it; one line."""
    for secret in secrets:
        text = text.replace(secret, "***")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = "; ".join(lines)
    return text if len(text) <= 600 else text[:597] + "..."


# Each command's module, imported when the command is asked for: a call loads what its
# command needs, not every command's dependencies (issue 31: start-up per call).
COMMANDS = {
    "show": "kvstate.cli.rooms",
    "ls": "kvstate.cli.rooms",
    "abort": "kvstate.cli.abort",
    "trace": "kvstate.cli.trace",
    "engines": "kvstate.cli.engines",
    "top": "kvstate.cli.top",
    "audit": "kvstate.cli.audit",
    "monitor": "kvstate.cli.monitor",
    "doctor": "kvstate.cli.doctor",
    "functions": "kvstate.cli.functions",
    "demo": "kvstate.demo",
}


class KVGroup(click.Group):
    """Turns kvstate errors (the store makes redis-py's kvstate's) and click's usage
    errors into one line and exit status 2; Ctrl-C into exit status 130 (click would
    print ``Aborted!``, exit 1). Loads a command's module when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if cmd_name not in self.commands and module is not None:
            try:  # a command module registers its command on import
                loaded = importlib.import_module(module)
            except ImportError:  # pragma: no cover - the demo's dependencies missing
                return None
            command = getattr(loaded, cmd_name, None)
            if isinstance(command, click.Command) and cmd_name not in self.commands:
                self.add_command(command)  # the demo, which does not register itself
        return super().get_command(ctx, cmd_name)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS as exc:  # `kvstate` alone: the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "kvstate"
            click.echo(f"kvstate: error: {exc.format_message()} (`{where} -h` for help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            interrupted = isinstance(exc.__cause__, KeyboardInterrupt)
            click.echo("kvstate: interrupted" if interrupted else "kvstate: aborted", err=True)
            sys.exit(128 + signal.SIGINT if interrupted else EXIT_FINDINGS)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            finally:  # what is still buffered goes now, while a closed pipe can be told
                sys.stdout.flush()
        except BrokenPipeError:  # `kvstate ls | head`: the reader is gone
            pipe_closed()
        except (KVStateError, OSError) as exc:
            obj = ctx.find_object(Ctx)
            raise CommandError(scrub(describe(exc), obj.secrets if obj else [])) from None


def describe(exc: BaseException) -> str:
    if isinstance(exc, RedisServerError):  # a KVStateError too: its hint first
        return f"embedded redis-server: {exc} (install redis-server or pass --url)"
    if isinstance(exc, KVStateError):
        return str(exc).replace(URL_SOURCE, CLI_URL_SOURCE)
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
    "namespace); 2 an error, printed as one line; 130 / 143 stopped by SIGINT / "
    "SIGTERM; 141 stdout's reader went away (`kvstate ls | head`).",
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
