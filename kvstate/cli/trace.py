"""``kvstate trace ROOM``: where a room's time went, step by step, after the fact.

Reads the room's trace list (kvstate.trace) with one LRANGE: every transition of
every participant, stamped by the Redis server's clock, kept for ``trace_ttl`` after
the room's clear. A room is traced only if it was sampled (``trace_rate``).
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import click
from rich.table import Table
from rich.text import Text

from kvstate import schema
from kvstate.cli.app import Ctx, common, main, opened
from kvstate.cli.output import ROWS, console, cut, emit_json, more, status_style, styled
from kvstate.keys import parse_room_text
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK
from kvstate.ops.timeline import Timeline, read_timeline
from kvstate.trace import TraceEntry, sampled


def _clock(ms: int) -> str:
    """A server timestamp for people: UTC, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%S.%f")[:-3]


def _detail(e: TraceEntry) -> str:
    f = dict(e.fields)
    out = []
    if e.event == schema.EV_CREATED and schema.STATUS in f:
        out.append(f.pop(schema.STATUS))
    if schema.TRACE_PEER in f:
        peer = f.pop(schema.TRACE_PEER)
        inc = f.pop(schema.INCARNATION, None)
        out.append(f"peer {peer}" + (f"@{inc}" if inc else ""))
    if schema.TRACE_WAS in f:
        out.append(f"was {f.pop(schema.TRACE_WAS)}")
    f.pop(schema.STATUS, None)
    reason = f.pop(schema.REASON, None)
    out += [f"{k}={v}" for k, v in sorted(f.items())]
    if reason:
        out.append(reason)
    return "; ".join(out)


def _event_style(e: TraceEntry) -> str:
    if e.event in (schema.EV_ABORT, "Failed"):
        return "red"
    if e.event in (schema.EV_CREATED, schema.EV_BOUND, schema.EV_PUBLISHED, schema.EV_CLEARED):
        return "default"
    return status_style(e.event)


def _table(t: Timeline, limit: int) -> Table:
    tab = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for name in ("server time (UTC)", "+ms", "at ms", "side", "engine", "event", "detail"):
        if name in ("+ms", "at ms"):
            tab.add_column(name, justify="right")
        else:  # names are never cut (tp0 and tp1 must not look the same)
            tab.add_column(name, overflow="fold")
    for e, delta in list(zip(t.entries, t.deltas(), strict=True))[:limit]:
        tab.add_row(
            _clock(e.ms),
            "" if delta is None else f"+{delta}",
            str(e.ms - t.start_ms),
            cut(e.side) or "room",
            cut(e.engine),
            styled(e.event, _event_style(e)),
            cut(_detail(e)),
        )
    left = max(t.stored, len(t.entries)) - min(limit, len(t.entries))
    if left > 0:
        tab.add_row(more(left, "steps (--limit)"))
    return tab


@main.command()
@common
@click.argument("room")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=ROWS,
    show_default=True,
    help="At most this many steps shown (a room of kvstate's takes a few dozen).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def trace(obj: Ctx, room: str, limit: int, as_json: bool) -> None:
    """Where ROOM's time went: every transition of every participant (created, bound,
    published, each status, abort, cleared) on the Redis server's clock, the gap
    since the step before, and the room's phases. Kept for the trace TTL after the
    room's clear, for sampled rooms (?trace_rate=, 1% by default). Exit status 1
    when the room has no trace."""
    r = parse_room_text(room)
    with opened(obj) as store:
        t = read_timeline(store, r)
        rate = store.options.trace_rate
        ns = store.namespace
    if as_json:
        emit_json({"namespace": ns, "trace_rate": rate, **t.to_json(limit)})
        sys.exit(EXIT_FINDINGS if t.empty else EXIT_OK)
    out = console()
    if t.empty:
        at = "would be" if sampled(r, rate) else "is not"
        out.print(
            f"room {r}: no trace: room not sampled or trace expired; sampling rate is "
            f"{rate:g} (room {r} {at} sampled at it; engines set it with "
            f"Options.trace_rate or ?trace_rate= in their URL), namespace {ns}"
        )
        sys.exit(EXIT_FINDINGS)
    out.print(
        Text(f"room {r}", style="bold"),
        f" namespace {ns}  trace expires in {fmt_ms(t.ttl_ms)}",
    )
    out.print(_table(t, limit))
    out.print(t.summary())
    sys.exit(EXIT_OK)
