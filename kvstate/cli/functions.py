"""``kvstate functions``: kvstate's Redis 7 FUNCTION libraries, an admin's business.

A FUNCTION library is server-wide and runs with each caller's rights, so whoever may
FUNCTION LOAD can change the code every namespace runs: docs/security.md's engine, operator
and reader users may not. An admin (a user with ``+function``, e.g. the default user)
loads this kvstate's library with ``load`` (engines verify its code before they run it
by FCALL, else they take the EVAL path) and removes the stale ones, that neither this
kvstate nor any live engine uses, with ``prune``; ``ls`` lists them (any user with
``+function|list``).
"""

from __future__ import annotations

import sys

import click
from rich.table import Table

from kvstate.cli.app import Ctx, common, main, opened
from kvstate.cli.output import console, emit_json, styled
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK, CommandError
from kvstate.ops.libraries import LibraryState, Survey, survey
from kvstate.store import LIBRARY_NAME, LIBRARY_VERSION


@main.group(name="functions")
def functions_group() -> None:
    """kvstate's FUNCTION libraries on the server (Redis 7): list, load, prune."""


def _used(lib: LibraryState, s: Survey) -> str:
    if lib.forged:
        return "NOT kvstate's code: engines do not run it (`kvstate functions load --replace`)"
    if lib.current:
        return f"this kvstate's; {lib.engines} live engine(s)"
    if lib.stale(s.unknown):
        return "stale: no live engine uses it (`kvstate functions prune`)"
    return f"{lib.engines} live engine(s)" + (" (others unknown)" if s.unknown else "")


def _print(s: Survey) -> None:
    out = console()
    if s.libraries:
        t = Table(box=None, header_style="bold")
        for name in ("node", "library", "kvstate", "used by"):
            t.add_column(name, overflow="fold")
        for lib in s.libraries:
            used = _used(lib, s)
            style = "red" if lib.forged else "yellow" if lib.stale(s.unknown) else "green"
            t.add_row(lib.node, lib.name, lib.version, styled(used, style))
        out.print(t)
    else:
        out.print(f"no kvstate library on the server (this kvstate's: {LIBRARY_NAME})")
    for node in s.no_function:
        out.print(f"{node}: no FUNCTION (Redis 6.2): scripts run by EVALSHA, nothing to list")
    for note in s.notes:
        out.print(f"note: {note}")


@functions_group.command(name="ls")
@common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def ls_libraries(obj: Ctx, as_json: bool) -> None:
    """kvstate's libraries on every primary: the kvstate version of each, whether it is
    this kvstate's, how many live engines (every namespace) use it. Exit status 1 when
    a stale or foreign-code library is there."""
    with opened(obj) as store:
        s = survey(store)
    if as_json:
        emit_json(s.to_json())
    else:
        _print(s)
    bad = s.stale or [lib for lib in s.libraries if lib.forged]
    sys.exit(EXIT_FINDINGS if bad else EXIT_OK)


@functions_group.command()
@common
@click.option(
    "--replace",
    is_flag=True,
    help="Replace a library of this kvstate's name that holds other code.",
)
@click.pass_obj
def load(obj: Ctx, replace: bool) -> None:
    """Load this kvstate's library on every primary (an admin's step: FUNCTION LOAD).
    Engines then run the scripts by FCALL (after they verified its code), from their
    next connect; until then, and without it, they take the EVAL path."""
    with opened(obj) as store:
        for node in store.primaries():
            if store.libraries(node) is None:
                click.echo(f"{node}: no FUNCTION (Redis 6.2): engines take the EVAL path")
                continue
            done = store.load_library(node, replace)
            click.echo(f"{node}: {LIBRARY_NAME} (kvstate {LIBRARY_VERSION}) {done}")


@functions_group.command()
@common
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Remove every library but this kvstate's, even when some live engine did not "
    "say which it uses (it then takes the EVAL path, or loads its own again).",
)
@click.pass_obj
def prune(obj: Ctx, dry_run: bool, force: bool) -> None:
    """Remove the kvstate libraries that neither this kvstate nor any live engine uses
    (an admin's step: FUNCTION DELETE). An engine whose library goes anyway loses only
    speed: its next call takes the EVAL path, or loads the library again."""
    with opened(obj) as store:
        s = survey(store)
        doomed = [
            lib
            for lib in s.libraries
            if lib.stale(s.unknown)
            or (force and not lib.current and not lib.forged and lib.engines == 0)
        ]
        for note in s.notes:
            click.echo(f"note: {note}", err=True)
        if s.unknown and not force:
            raise CommandError(
                f"{s.unknown} live engine(s) did not say which library they use: nothing "
                "removed. Run as a user that may read every namespace, or pass --force"
            )
        for lib in doomed:
            gone = dry_run or store.delete_library(lib.name, lib.node)
            verb = "would remove" if dry_run else "removed" if gone else "already gone:"
            click.echo(f"{lib.node}: {verb} {lib.name} (kvstate {lib.version})")
    if not doomed:
        click.echo("no stale kvstate library")
