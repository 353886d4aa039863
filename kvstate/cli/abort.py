"""``kvstate abort``: fail every participant of a room and mark it, so a participant
that joins later starts Failed too; refused, with what to do, where an abort cannot
reach (a corrupt room, an unlisted or wrong-typed participant)."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from kvstate.cli.app import Ctx, common, main, opened
from kvstate.cli.output import emit_json
from kvstate.keys import parse_room_text
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK, CommandError
from kvstate.ops.views import WRONG_TYPE, RoomView, room_view

MAX_REASON = 1000  # characters of an operator's --reason


@main.command()
@common
@click.argument("room")
@click.option(
    "--reason",
    default="aborted by operator (kvstate abort)",
    show_default=True,
    callback=lambda ctx, param, value: _short_reason(value),
    help=f"CommandError reason both sides will see (at most {MAX_REASON} characters).",
)
@click.option(
    "--pre-emptive",
    "pre_emptive",
    is_flag=True,
    help="Mark a room that has no participant yet (a router cancelling a request "
    "before either side joined): whoever joins while the mark lasts (the room TTL, "
    "at least 300 s) starts Failed, once per engine (its next join, after all cleared, is "
    "a new request). Without it, aborting an empty room is refused (exit 1).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.pass_obj
def abort(obj: Ctx, room: str, reason: str, pre_emptive: bool, as_json: bool) -> None:
    """Fail every participant of ROOM (one whose status is garbage too); each side sees
    Failed with REASON on its next poll, and a participant created later (while the
    room's failure mark lasts: the room TTL, at least 300 s) starts Failed, unless its
    engine took part and every participant cleared (a new request under the same id).
    A room that already failed keeps its first reason. Exit status 1 when there is nothing to abort
    (finished and cleared, mistyped, or another namespace)."""
    r = parse_room_text(room)
    with opened(obj) as store:
        view = room_view(store, r)
        doc: dict[str, Any] = {
            "room": r,
            "namespace": store.namespace,
            "participants": view.members,
            "reason": reason,
            "failed": 0,
            "marked": False,
            "already_aborted": view.aborted,
        }
        if view.aborted is not None:
            _said(
                doc,
                as_json,
                f"room {r}: already failed ({view.aborted}); left as is: its "
                "participants, and any that joins while the mark lasts, fail with that "
                f"reason; mark expires in {fmt_ms(view.aborted_ttl_ms)}",
            )
        _refuse_what_abort_cannot_reach(r, view)
        if not view.members and not pre_emptive:
            _said(
                doc,
                as_json,
                f"room {r}: nothing to abort in namespace {store.namespace} (no "
                "participant: finished and cleared, reaped, mistyped, or another "
                "namespace); nothing written. To fail whoever joins later, pass "
                "--pre-emptive",
                EXIT_FINDINGS,
            )
        doc["failed"] = n = store.abort(r, reason)
        doc["marked"] = True
    gone = view.missing_members  # listed, but their hash is gone: nothing to fail there
    doc["gone"] = gone
    if not view.members:
        text = (
            f"room {r}: no participants yet; marked aborted, so either side that "
            f"joins while the mark lasts starts Failed; reason: {reason}"
        )
    else:
        present = [m for m in view.members if m not in gone]
        failed_before = [p.member for p in view.participants if p.status == "Failed"]
        parts = [f"failed {n} of {len(present)} participant(s)"]
        if present:
            parts[0] += f" ({', '.join(present)})"
        if failed_before:
            parts.append(f"already failed: {', '.join(failed_before)}")
        if gone:
            parts.append(
                f"listed but gone (no hash, nothing to fail): {', '.join(gone)}; "
                "`kvstate audit --fix` removes the listing"
            )
        text = f"room {r}: " + "; ".join(parts) + f"; marked aborted; reason: {reason}"
    _said(doc, as_json, text)


def _short_reason(reason: str) -> str:
    """A reason is stored in every participant and the failure mark, and printed by
    show, ls, trace and the engines' logs: one line of text, not a document."""
    if len(reason) > MAX_REASON:
        raise click.BadParameter(
            f"is {len(reason)} characters long: give at most {MAX_REASON} (it is stored "
            "in each participant and printed wherever the room is shown)"
        )
    return reason


def _refuse_what_abort_cannot_reach(room: int, view: RoomView) -> None:
    """Say, before anything is written, what an abort of this room cannot get past."""
    if view.corrupt:
        raise CommandError(
            f"room {room}: {view.corrupt[0]}, so abort cannot read the room; nothing "
            "written. Look at it, delete it (redis-cli DEL KEY), then abort again"
        )
    if not view.members and view.participants:
        raise CommandError(
            f"room {room} has participants its room hash does not list; "
            "run `kvstate audit --fix` to re-index them, then abort again"
        )
    for p in view.participants:
        if p.status == WRONG_TYPE:
            raise CommandError(
                f"room {room}: {p.key} is not a hash (no kvstate code wrote it), so abort "
                f"cannot fail it; nothing written. Delete it (redis-cli DEL {p.key}), "
                "then abort again"
            )


def _said(doc: dict[str, Any], as_json: bool, text: str, code: int = EXIT_OK) -> NoReturn:
    """Print what abort did (or why it did nothing), as text or JSON; exit with ``code``."""
    if as_json:
        emit_json({**doc, "message": text})
    else:
        click.echo(text, err=code != EXIT_OK)
    sys.exit(code)
