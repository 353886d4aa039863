"""Commands that read rooms: ``show`` one, ``ls`` participants (``abort`` is abort.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click
from rich.table import Table
from rich.text import Text

from kvstate.cli.app import (
    DURATION,
    PERIOD,
    Ctx,
    common,
    empty_json,
    empty_namespace_note,
    main,
    opened,
)
from kvstate.cli.output import ROWS, console, cut, emit_json, more, name_width, status_style, styled
from kvstate.cli.watch import watching
from kvstate.keys import parse_room_text
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK
from kvstate.ops.infos import fmt_ranges, info_json
from kvstate.ops.views import (
    StoredParticipant,
    room_view,
    scan_participants,
)
from kvstate.poll import KVPoll
from kvstate.store import Store

if TYPE_CHECKING:  # decoded by the views when `show` needs them (msgpack, numpy)
    from kvstate.codec import TransferInfo


def _participants_table(parts: list[StoredParticipant], with_room: bool) -> Table:
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    if with_room:
        t.add_column("room", justify="right")
    for name in ("side", "engine", "status", "age", "in status", "ttl", "reason / peers"):
        # names are never cut: "...tp0" and "...tp1" must not look the same at 80 columns
        t.add_column(
            name,
            overflow="fold" if name == "engine" else "ellipsis",
            min_width=name_width(p.engine for p in parts) if name == "engine" else None,
        )
    for p in parts:
        extra = p.reason or ""
        if not extra and p.side == "rx":
            extra = (
                f"peer {cut(p.fields.get('peer_addr', '?'))}: "
                + ", ".join(f"{cut(e)}@{cut(inc)}" for e, inc in sorted(p.bindings.items())[:8])
                + (f" {more(len(p.bindings) - 8)}" if len(p.bindings) > 8 else "")
            )
        status = styled(p.status or "?", status_style(p.status))
        row: list[str | Text] = [
            p.side,
            cut(p.engine),
            status,
            fmt_ms(p.age_ms),
            fmt_ms(p.in_status_ms),
            fmt_ms(p.pttl_ms),
            cut(extra),
        ]
        t.add_row(*([str(p.room)] if with_room else []), *row)
    return t


def _infos_table(infos: dict[str, dict[str, TransferInfo | str]]) -> Table:
    """Decoded transfer infos, one row per (sender, receiver); undecodable ones in red."""
    t = Table(title="transfer infos", title_justify="left", box=None, header_style="bold")
    for name in (
        "sender",
        "receiver",
        "pages",
        "runs",
        "pages at",
        "aux",
        "prefix",
        "moves",
        "incarnation",
    ):
        t.add_column(name, overflow="fold" if name in ("sender", "receiver") else "ellipsis")
    rows = [(s, r, i) for s, per in sorted(infos.items()) for r, i in sorted(per.items())]
    for sender, receiver, info in rows[:ROWS]:
        if isinstance(info, str):
            t.add_row(cut(sender), cut(receiver), styled(info, "red"))
            continue
        j = info_json(info)
        t.add_row(
            cut(sender),
            cut(receiver),
            str(j["pages"]),
            str(j["runs"]),
            fmt_ranges(j["ranges"], total=j["runs"]),
            str(j["aux_index"]),
            str(j["prefix_len"]),
            j["moves"],
            cut(j["incarnation"]) or "-",
        )
    if len(rows) > ROWS:
        t.add_row(more(len(rows) - ROWS, "transfer infos"))
    return t


@main.command()
@common
@click.argument("room")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=ROWS,
    show_default=True,
    help="At most this many participants (and members, transfer infos, acks) shown.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--watch",
    type=PERIOD,
    metavar="PERIOD",
    help="Show it again every PERIOD (2s, or 2 for seconds) until Ctrl-C.",
)
@click.pass_obj
def show(obj: Ctx, room: str, limit: int, as_json: bool, watch: float | None) -> None:
    """Every participant of ROOM, its status, age, TTL, decoded transfer infos and abort
    mark. Exit status 1 when nothing is stored for the room."""
    r = parse_room_text(room)
    with opened(obj) as store:
        if watch is not None:
            watching(
                obj, store, watch, f"show {r}", lambda: _show(store, r, as_json, limit), as_json
            )
        code = _show(store, r, as_json, limit)
    sys.exit(code)


def _show(store: Store, r: int, as_json: bool, limit: int) -> int:
    """Print one look at room ``r``; answers the exit status."""
    view = room_view(store, r)
    if as_json:
        emit_json(view.to_json(limit))
        return EXIT_FINDINGS if view.empty else EXIT_OK
    out = console()
    if view.empty:
        out.print(
            f"room {r}: nothing stored (cleared, reaped by TTL, or never created) in "
            f"namespace {store.namespace}"
        )
        if view.traced:
            out.print(f"its trace is kept: kvstate trace {r} shows where its time went")
        return EXIT_FINDINGS
    out.print(styled(f"room {r}", "bold"), f" namespace {store.namespace}  {store.url}")
    if view.aborted is not None:
        out.print(
            styled(
                f"aborted: {cut(view.aborted)} (mark expires in "
                f"{fmt_ms(view.aborted_ttl_ms)}; a participant joining before then "
                "starts Failed, unless the mark names it and nobody is left: a new "
                "request)",
                "red",
            )
        )
        if view.aborted_named:
            names = ", ".join(cut(m) for m in view.aborted_named[:limit])
            out.print(f"the mark names the failed request's participants: {names}")
    for what in view.corrupt:
        out.print(styled(f"corrupt: {what}", "red"))
    if view.participants:
        out.print(_participants_table(view.participants[:limit], with_room=False))
        if len(view.participants) > limit:
            out.print(more(len(view.participants) - limit, "participants (--limit)"))
    elif view.aborted is not None:
        out.print("no participants")
    for member in view.missing_members[:limit]:
        out.print(
            styled(
                f"the room hash lists {cut(member)} but its participant hash is gone: "
                "`kvstate audit --fix` removes the listing",
                "red",
            )
        )
    for member in view.unindexed[:limit]:
        out.print(
            styled(
                f"{cut(member)} is missing from the room hash: `kvstate abort` "
                "cannot reach it; `kvstate audit --fix` re-indexes it",
                "red",
            )
        )
    if view.infos:
        out.print(_infos_table(view.infos))
    for receiver, senders in sorted(view.acks.items())[:limit]:
        shown = ", ".join(cut(s) for s in senders[:8])
        out.print(
            f"acks for {cut(receiver)}: {shown}"
            + (f" {more(len(senders) - 8)}" if len(senders) > 8 else "")
        )
    if view.held_until_ms is not None and view.held_until_ms > view.now_ms:
        left = fmt_ms(view.held_until_ms - view.now_ms)
        out.print(f"held by a decode engine's queue for {left} more (its senders wait)")
    if view.traced:
        out.print(f"trace: kvstate trace {r} (every step so far, on the server clock)")
    return EXIT_OK


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


@dataclass
class _Filter:
    """What ``ls`` shows: every given criterion must hold."""

    statuses: set[str]
    side: str | None
    engine: str | None
    min_age_ms: int | None

    def matches(self, p: StoredParticipant) -> bool:
        return (
            (not self.statuses or p.status in self.statuses)
            and (self.side is None or p.side == self.side)
            and (self.engine is None or p.engine == self.engine)
            and (self.min_age_ms is None or (p.age_ms or 0) >= self.min_age_ms)
        )


def _by_room(parts: list[StoredParticipant]) -> list[StoredParticipant]:
    """Oldest room first, a room's participants together (senders, then receivers):
    sides created a millisecond apart must not be split by another room's rows."""
    oldest: dict[int, int] = {}
    for p in parts:
        oldest[p.room] = max(oldest.get(p.room, 0), p.age_ms or 0)
    return sorted(parts, key=lambda p: (-oldest[p.room], p.room, p.side != "tx", p.engine))


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
@click.option(
    "--watch",
    type=PERIOD,
    metavar="PERIOD",
    help="List again every PERIOD (2s, or 2 for seconds) until Ctrl-C.",
)
@click.pass_obj
def ls(
    obj: Ctx,
    statuses: tuple[str, ...],
    side: str | None,
    older_than: float | None,
    engine: str | None,
    limit: int,
    as_json: bool,
    watch: float | None,
) -> None:
    """List participants (SCAN, never KEYS), oldest first. Exit status 1 when the
    namespace holds no kvstate key at all (a mistyped -n), 0 when none matches."""
    wanted = _Filter(
        _status_names(statuses),
        side,
        engine,
        None if older_than is None else int(older_than * 1000),
    )
    with opened(obj) as store:
        if watch is not None:
            watching(obj, store, watch, "ls", lambda: _ls(store, wanted, limit, as_json), as_json)
        code = _ls(store, wanted, limit, as_json)
    sys.exit(code)


def _ls(store: Store, wanted: _Filter, limit: int, as_json: bool) -> int:
    """Print one listing; answers the exit status."""
    found = [p for p in scan_participants(store) if wanted.matches(p)]
    note = None if found else empty_namespace_note(store)
    doc_empty = empty_json(store, note) if note and as_json else {}
    found = _by_room(found)
    shown = found[:limit]
    if as_json:
        emit_json({"count": len(found), "participants": [p.to_json() for p in shown], **doc_empty})
        return EXIT_FINDINGS if note else EXIT_OK
    out = console()
    if not found:
        out.print(note or "no participants match")
        return EXIT_FINDINGS if note else EXIT_OK
    out.print(_participants_table(shown, with_room=True))
    if len(found) > limit:
        out.print(more(len(found) - limit, "(--limit)"))
    out.print(f"{len(found)} participant(s)")
    return EXIT_OK
