"""The kinds of audit finding, in one table, and the records of them (``Finding``, a
whole audit's ``Report``): the audit reports them, the metrics label
them, the CLI hints at their fix and docs/cli.md lists them (a test keeps it exact).

A kind's ``name`` is what every reader sees: the audit's JSON and table, the ledger's
``audit:<name>`` events, the ``kind`` label of ``kvstate_audit_findings``, the
table in docs/cli.md. Renaming one breaks dashboards and scripts: add a kind rather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstate import schema
from kvstate.errors import KVStateError, PermissionDeniedError
from kvstate.keys import RoomKey
from kvstate.schema import Side


@dataclass(frozen=True)
class FindingKind:
    """One kind of leak or risk: what the audit checks, what ``audit --fix`` does about
    it (``fix``; empty when it is reported only, and ``left`` says why), and the short
    hint the CLI prints next to a finding when run without ``--fix``."""

    name: str
    check: str
    hint: str
    fix: str = ""
    left: str = ""  # may name the finding's {room}

    @property
    def fixable(self) -> bool:
        return bool(self.fix)

    def left_for(self, room: int | None) -> str:
        """Why ``--fix`` left a finding of this kind, as the audit reports it."""
        return self.left.format(room=room)

    def readme_row(self) -> str:
        """This kind's row of the findings table in docs/cli.md."""
        fix = self.fix or f"none; {self.left.format(room='ROOM')}"
        return f"| `{self.name}` | {self.check} | {fix} |"


KINDS: tuple[FindingKind, ...] = (
    FindingKind(
        "no_ttl",
        check="a kvstate key has no TTL (PTTL -1): nothing will ever reap it",
        hint="--fix sets a TTL",
        fix="sets the room's remaining TTL (the ledger: 7 days; `--room-ttl` when no key "
        "of the room has one), only if the key still has none",
    ),
    FindingKind(
        "terminal_uncleared",
        check="a participant has been Success or Failed for longer than the grace "
        "period and its owner never called `clear()`",
        hint="TTL reaps it; fix the owner's clear()",
        left="left for its TTL: the owner may still read the status",
    ),
    FindingKind(
        "stuck",
        check="a participant is past its bootstrap or waiting timeout and nobody polled it since",
        hint="--fix fails it",
        fix="fails it with the timeout reason (the poll script)",
    ),
    FindingKind(
        "orphan_tracker",
        check="an address tracker lists a participant that is gone (a clear "
        "interrupted between the room and the tracker)",
        hint="--fix ZREMs",
        fix="ZREMs the member",
    ),
    FindingKind(
        "unclaimed_xfer",
        check="a room-hash field of transfer infos (or acks) whose sender and receiver "
        "(the receiver) all neither exist nor are in the room: no clear will take it",
        hint="--fix deletes",
        fix="deletes the field, unless a participant it names appeared meanwhile",
    ),
    FindingKind(
        "dead_engine",
        check="a receiver bound to a peer whose lease is gone or whose incarnation changed",
        hint="--fix fails it",
        fix="fails the receiver, naming the peer",
    ),
    FindingKind(
        "dead_owner",
        check="a live participant whose own engine holds no lease: nobody will move it again",
        hint="--fix fails it",
        fix="fails it",
    ),
    FindingKind(
        "unindexed",
        check="a participant missing from its room hash (the hash expired "
        "first, or a clear was cut short): `abort` and `show` cannot reach it",
        hint="--fix re-indexes it",
        fix="adds it back to the room hash, with the room's remaining TTL",
    ),
    FindingKind(
        "stale_member",
        check="a room hash lists a participant whose hash is gone (deleted by hand, or "
        "expired while the room hash was kept alive): `show` marks it, `abort` finds "
        "nothing to fail there, and no clear will take the listing",
        hint="--fix removes the listing",
        fix="removes the listing and the fields the participant's clear would have "
        "taken (its transfer infos or acks), only if its hash is still gone",
    ),
    FindingKind(
        "corrupt",
        check="a participant whose `status`, or a number the scripts read (`peers`, "
        "`bound`, `infos_v`, `timeouts_ms`, `since_ms`/`created_ms`), does not parse (no "
        "call on it can succeed); or any kvstate key of the wrong Redis type (a "
        "participant, room hash, mark, trace, registration, index, tracker, counters, "
        "the ledger)",
        hint="--fix aborts its room",
        fix="aborts its room, as `kvstate abort ROOM` does (a garbage value is failed "
        "like any other); a key of the wrong type is left (its `fix` hint says so): no "
        "kvstate code wrote it, delete it after a look, then `kvstate abort ROOM` for a "
        "room's",
    ),
    FindingKind(
        "server_setting",
        check="`maxmemory-policy` other than `noeviction`: every kvstate key has a TTL, "
        "so `volatile-*` policies evict live rooms first",
        hint="CONFIG SET by an admin",
        left="needs an admin (server configuration)",
    ),
    FindingKind(
        "stale_library",
        check="a kvstate FUNCTION library (Redis 7) that neither this kvstate nor any "
        "live engine of any namespace uses: left by an older version",
        hint="`kvstate functions prune`, as an admin",
        left="needs an admin: `kvstate functions prune` removes it",
    ),
    FindingKind(
        "foreign_library",
        check="a FUNCTION library named as this kvstate's holds other code (loaded by "
        "someone else first, or replaced): engines take the EVAL path",
        hint="look, then `kvstate functions load --replace`, as an admin",
        left="needs an admin: look at it, then `kvstate functions load --replace`",
    ),
)
NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
_BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> FindingKind:
    """The kind called ``name``; a KeyError names the known ones (a new check must add
    its kind to KINDS first)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"no finding kind {name!r}; add it to kvstate.ops.findings.KINDS (known: "
            f"{', '.join(NAMES)})"
        ) from None


@dataclass
class Finding:
    """One leak or risk: ``kind`` (see NAMES), the key it is about, what is wrong,
    and, after a fix, what was done (``fixed``), why nothing was (``left``), or that
    nothing was needed any more (``resolved``: cleared or moved on meanwhile)."""

    kind: str
    key: str
    detail: str
    room: int | None = None
    side: str = ""
    engine: str = ""
    status: str = ""
    age_ms: int | None = None
    fixed: str = ""
    left: str = ""
    resolved: str = ""
    target: tuple[str, ...] = ()  # what a fix acts on (tracker member; peer, incarnation)
    advice: str = ""  # what --fix does about this one, when not what its kind says

    def __post_init__(self) -> None:
        kind(self.kind)  # every kind is in the table

    @property
    def hint(self) -> str:
        """What ``--fix`` would do about this finding (the CLI's ``fix`` column)."""
        return self.advice or kind(self.kind).hint

    @property
    def part(self) -> tuple[Side, str]:
        """(side, engine) of the participant the finding is about, for its repair."""
        side = schema.side_of(self.side)
        if side is None:
            raise KVStateError(f"{self.kind} finding on {self.key} names no participant")
        return side, self.engine

    @property
    def ident(self) -> tuple[str, str, tuple[str, ...]]:
        """What makes two looks at the state the same finding."""
        return self.kind, self.key, self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "detail": self.detail,
            "room": self.room,
            "side": self.side,
            "engine": self.engine,
            "status": self.status,
            "age_ms": self.age_ms,
            "fixed": self.fixed,
            "left": self.left,
            "resolved": self.resolved,
            "hint": self.hint,
        }


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scanned: int = 0

    @property
    def remaining(self) -> list[Finding]:
        """Findings neither repaired nor gone by themselves."""
        return [f for f in self.findings if not f.fixed and not f.resolved]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(NAMES, 0)
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        """The report; at most ``limit`` findings, ``findings_more`` saying how many
        more there are (the counts cover them all)."""
        return {
            "clean": not self.remaining,
            "scanned_keys": self.scanned,
            "findings": [f.to_json() for f in self.findings[:limit]],
            "findings_more": len(self.findings) - len(self.findings[:limit]),
            "fixed": sum(1 for f in self.findings if f.fixed),
            "resolved": sum(1 for f in self.findings if f.resolved),
            "left": len(self.remaining),
            "notes": self.notes,
        }


def acl_refused(exc: BaseException) -> bool:
    """A command refused by the server's ACL."""
    return isinstance(exc, PermissionDeniedError)


def cut_value(value: object, n: int = 60) -> str:
    """A stored value named in a finding: a hostile one may be megabytes."""
    text = "" if value is None else str(value)
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} chars)"


def delete_then_abort(key: str, room: int | RoomKey | None) -> str:
    if isinstance(room, RoomKey):
        room = room.room
    then = "" if room is None else f", then kvstate abort {room}"
    return (
        f"no kvstate code wrote it, so --fix leaves it: look at it (redis-cli TYPE "
        f"{key}), delete it (redis-cli DEL {key}){then}"
    )


WRONG_TYPE_HINT = "--fix leaves it: delete it after a look, then kvstate abort ROOM"


def readme_table() -> str:
    """The findings table, as docs/cli.md must show it."""
    head = "| kind | found when | `--fix` |\n| --- | --- | --- |\n"
    return head + "\n".join(k.readme_row() for k in KINDS) + "\n"
