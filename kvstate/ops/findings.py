"""The kinds of audit finding, in one table: the audit reports them, the metrics label
them, the CLI hints at their fix and docs/cli.md lists them (a test keeps it exact).

A kind's ``name`` is what every reader sees: the audit's JSON and table, the ledger's
``audit:<name>`` events, the ``kind`` label of ``kvstate_audit_findings``, the
table in docs/cli.md. Renaming one breaks dashboards and scripts: add a kind rather.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def readme_table() -> str:
    """The findings table, as docs/cli.md must show it."""
    head = "| kind | found when | `--fix` |\n| --- | --- | --- |\n"
    return head + "\n".join(k.readme_row() for k in KINDS) + "\n"
