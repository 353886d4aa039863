"""``kvstate audit``: name leaked or risky state, repair what is safe, show the ledger."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from kvstate.cli.app import DURATION, Ctx, common, empty_json, empty_namespace_note, main, opened
from kvstate.cli.output import ROWS, console, cut, emit_json, more, styled
from kvstate.defaults import ROOM_TTL
from kvstate.errors import CorruptStateError, KVStateError
from kvstate.ops.audit import DEFAULT_GRACE, Auditor, Report, acl_refused
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK
from kvstate.ops.ledger import Entry, Ledger
from kvstate.store import Store


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
    default=ROOM_TTL,
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
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=ROWS,
    show_default=True,
    help="At most this many findings listed (all are counted, and fixed with --fix).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def audit(
    obj: Ctx,
    fix: bool,
    grace: float,
    room_ttl: float,
    ledger_n: int,
    limit: int,
    as_json: bool,
) -> None:
    """Find leaked or risky state. Exit status 0 when clean, 1 when anything is left
    unrepaired, or when the namespace holds no kvstate key at all."""
    with opened(obj, room_ttl=room_ttl) as store:
        report = Auditor(store, grace).run(fix=fix)
        recent = _recent_ledger(store, ledger_n, report.notes)
        empty = empty_namespace_note(store) if not report.scanned else None
        extra = empty_json(store, empty) if empty and as_json else {}
    code = EXIT_FINDINGS if report.remaining or empty else EXIT_OK
    if as_json:
        emit_json({**report.to_json(limit), "ledger": [e.to_json() for e in recent], **extra})
        sys.exit(code)
    out = console()
    for note in report.notes[:limit]:
        out.print(styled("note:", "yellow"), cut(note, 600))
    if report.findings:
        out.print(_findings_table(report, fix, limit))
    out.print(empty or _summary(report, store.namespace))
    if recent:
        out.print(_ledger_table(recent))
    sys.exit(code)


def _findings_table(report: Report, fix: bool, limit: int) -> Table:
    """One row per finding (the first ``limit``): red while left, green once fixed or
    resolved; without --fix the last column hints at what --fix would do."""
    t = Table(box=None, header_style="bold")
    for name in ("kind", "key", "detail", "action" if fix else "fix"):
        t.add_column(name, overflow="fold")
    left = set(map(id, report.remaining))
    for f in report.findings[:limit]:
        action = f.fixed or f.resolved or f.left or ("" if fix else f.hint)
        t.add_row(
            styled(f.kind, "red" if id(f) in left else "green"),
            cut(f.key),
            cut(f.detail, 600),
            cut(action, 600),
        )
    if len(report.findings) > limit:
        t.add_row(more(len(report.findings) - limit, "findings (--limit)"))
    return t


def _summary(report: Report, namespace: str) -> str:
    if not report.findings:
        return f"clean: {report.scanned} key(s) checked in namespace {namespace}"
    fixed = sum(1 for f in report.findings if f.fixed)
    resolved = sum(1 for f in report.findings if f.resolved)
    return (
        f"{len(report.findings)} finding(s), {fixed} fixed, "
        + (f"{resolved} resolved meanwhile, " if resolved else "")
        + f"{len(report.remaining)} left ({report.scanned} key(s) checked)"
    )


def _recent_ledger(store: Store, n: int, notes: list[str]) -> list[Entry]:
    """The newest ledger entries; a user without stream rights gets a note instead."""
    if not n:
        return []
    try:
        return Ledger(store).recent(n)
    except CorruptStateError as exc:  # the ledger is not a stream: the audit names it
        notes.append(f"the ledger cannot be read ({exc})")
        return []
    except KVStateError as exc:
        if not acl_refused(exc):
            raise
        notes.append(
            "XREVRANGE is not allowed for this user: the ledger is not shown (the "
            "operator ACL line in kvstate's docs/security.md allows it)"
        )
        return []


def _ledger_table(entries: list[Entry]) -> Table:
    t = Table(title="ledger (newest first)", title_justify="left", box=None, header_style="bold")
    for name in ("id", "event", "room", "side", "engine", "last status", "age", "detail"):
        t.add_column(name)
    for e in entries:
        t.add_row(
            e.id,
            cut(e.event),
            "" if e.room is None else str(e.room),
            cut(e.side),
            cut(e.engine),
            cut(e.status),
            fmt_ms(e.age_ms),
            cut(e.detail),
        )
    return t
