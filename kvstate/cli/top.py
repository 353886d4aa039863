"""``kvstate top``: live counts of participants by status and age, engines alive."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvstate.cli.app import (
    PERIOD,
    Ctx,
    common,
    describe,
    empty_json,
    empty_namespace_note,
    main,
    opened,
)
from kvstate.cli.output import console, emit_json, status_style, styled
from kvstate.cli.process import Stopper
from kvstate.errors import KVStateError
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK, CommandError
from kvstate.ops.views import AGE_BUCKETS, STATUSES, Census, scan_participants
from kvstate.registry import Registry
from kvstate.store import Store


def _census(store: Store) -> tuple[Census, dict[str, int], str | None]:
    census = Census.of(scan_participants(store))
    roles: dict[str, int] = {}
    infos, corrupt = Registry(store).all_read()
    for info in infos:
        role = info.role if info.role in ("prefill", "decode") else "other"
        roles[role] = roles.get(role, 0) + 1
    if corrupt:  # counted, not fatal: `kvstate engines` and `audit` name them
        roles["corrupt"] = len(corrupt)
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
        t.add_row(styled(st, status_style(st)), str(tx), str(rx), str(tx + rx))
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
            extra = empty_json(store, note) if note else {}
            emit_json({**census.to_json(), "engines": roles, **extra})
            sys.exit(EXIT_FINDINGS if note else EXIT_OK)
        out = console()
        if once:
            out.print(_top_view(store, census, roles, note))
            sys.exit(EXIT_FINDINGS if note else EXIT_OK)
        with Stopper() as stopper:
            _live_top(store, out, interval, (census, roles, note), stopper, obj.gone)
    sys.exit(stopper.exit_code)


def _live_top(
    store: Store,
    out: Console,
    interval: float,
    first: tuple[Census, dict[str, int], str | None],
    stopper: Stopper,
    gone: Callable[[], str | None],
) -> None:
    """Refresh until Ctrl-C or SIGTERM; a lost Redis is shown and waited for, not fatal
    (a restart or failover must not end the operator's view), unless it is gone for
    good (``gone``: a demo's embedded server whose demo exited)."""
    last, lost_since = first, None
    with Live(_top_view(store, *last), console=out, auto_refresh=False) as live:
        while not stopper.wait(interval):
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
                why = gone()
                if why is not None:
                    raise CommandError(why) from None
                if lost_since is None:
                    lost_since = time.monotonic()
                    click.echo(
                        f"kvstate top: {describe(exc)}; waiting for it (Ctrl-C to stop)", err=True
                    )
                trouble = (
                    f"Redis unreachable for {time.monotonic() - lost_since:.0f}s "
                    "(showing the last counts); retrying"
                )
            live.update(_top_view(store, *last, trouble=trouble), refresh=True)
