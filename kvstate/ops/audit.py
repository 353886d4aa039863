"""The audit: find, name and (where safe) repair every kind of leaked room state.

One SCAN of ``kvstate:<ns>:*`` on every primary, then batched reads. Ages use the
server clock. ``fix=True`` repairs only what cannot hurt a live request. The kinds
of finding, what each means and what ``fix`` does about it are one table,
:mod:`kvstate.ops.findings`, which the metrics, the CLI and docs/cli.md use too.

A live participant is never deleted. Every repair is appended to the ledger.

A finding must hold on a second look: on a busy namespace SCAN sees keys that a
clear() removes a moment later, so every finding of the first pass is checked again
on fresh reads of its keys and only those found both times are reported. The repairs
are kvstate.ops.repairs'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstate import schema
from kvstate.defaults import AUDIT_GRACE
from kvstate.errors import (
    KVStateError,
    PermissionDeniedError,
)
from kvstate.keys import RoomKey
from kvstate.ops import reads
from kvstate.ops.durations import fmt_ms
from kvstate.ops.findings import (
    WRONG_TYPE_HINT,
    Finding,
    Report,
    acl_refused,
    cut_value,
    delete_then_abort,
)
from kvstate.ops.repairs import Repairs
from kvstate.ops.server_audit import server_findings
from kvstate.ops.views import BATCH, WRONG_TYPE, StoredParticipant, read_participants
from kvstate.registry import Registry
from kvstate.schema import Side
from kvstate.store import Store

DEFAULT_GRACE = AUDIT_GRACE
# The Redis type of each kind of kvstate key (docs/design.md, Data model), and its name
_TYPES = {
    "participant": ("hash", "participant"),
    "room": ("hash", "room hash"),
    "aborted": ("hash", "failure mark"),
    "trace": ("list", "room trace"),
    "addr": ("zset", "address tracker"),
    "engine": ("hash", "engine registration"),
    "engines_at": ("zset", "address index"),
    "stats": ("hash", "transfer counters"),
    "ledger": ("stream", "ledger"),
    "probe": ("string", "expiry probe"),
}


def _locate(f: Finding, parsed: RoomKey | None) -> None:
    """Fill in the room (and participant) a finding's key names."""
    if parsed is not None:
        f.room = parsed.room
        if parsed.side is not None:
            f.side, f.engine = parsed.side, parsed.rest


def _about(kind: str, p: StoredParticipant, detail: str) -> Finding:
    return Finding(
        kind,
        p.key,
        detail,
        room=p.room,
        side=p.side,
        engine=p.engine,
        status=p.status,
        age_ms=p.age_ms,
    )


class Auditor:
    """Audits one namespace. ``grace``: seconds a terminal participant may wait for
    its clear before it counts."""

    def __init__(self, store: Store, grace: float = DEFAULT_GRACE) -> None:
        self.store = store
        self.keys = store.keys
        self.grace_ms = int(grace * 1000)

    # -- driver ------------------------------------------------------------------
    def run(self, fix: bool = False) -> Report:
        report = Report()
        server_findings(self.store, report)
        all_keys = sorted(set(self.store.scan(self.keys.all_pattern)))
        report.scanned = len(all_keys)
        first = self._detect(all_keys, report.notes)
        if first:  # the second look: fresh reads of only the keys involved
            again = self._detect(sorted({f.key for f in first}), report.notes)
            kept = {f.ident for f in first}
            report.findings += [f for f in again if f.ident in kept]
        if fix:
            Repairs(self.store).fix(report)
        return report

    def _detect(self, keys: Sequence[str], notes: list[str]) -> list[Finding]:
        """Every check but the server settings, on ``keys`` as they are now. A key of
        the wrong Redis type is a finding of its own and left out of the checks that
        read it (one hostile key must not blind the audit to the rest)."""
        scratch = Report(notes=notes)
        now = self.store.server_time_ms()
        groups = self._classify(keys)
        self._no_ttl(keys, scratch)
        self._wrong_types(groups, scratch)
        parts = read_participants(self.store, groups["participant"], now)
        self._participants(parts, now, scratch)
        self._dead_engines(parts, scratch)
        self._unindexed(parts, scratch)
        self._trackers(groups["addr"], scratch)
        self._room_data(groups["room"], scratch)
        return scratch.findings

    def _classify(self, all_keys: Sequence[str]) -> dict[str, list[str]]:
        k = self.keys
        prefixes = {
            "addr": k.addr(""),
            "engine": k.engine(""),
            "engines_at": k.engines_at(""),
            "stats": k.transfer_stats(""),
        }
        groups: dict[str, list[str]] = {name: [] for name in (*_TYPES, "other")}
        for key in all_keys:
            parsed = k.parse_room_key(key)
            if parsed is not None and parsed.side is not None:
                groups["participant"].append(key)
            elif parsed is not None and parsed.kind in ("room", "aborted", "trace"):
                groups[parsed.kind if not parsed.rest else "other"].append(key)
            elif key == k.ledger:
                groups["ledger"].append(key)
            elif k.is_probe(key):
                groups["probe"].append(key)
            else:
                kind = next((n for n, pre in prefixes.items() if key.startswith(pre)), "other")
                groups[kind].append(key)
        return groups

    def _wrong_types(self, groups: dict[str, list[str]], report: Report) -> None:
        """Each kvstate key whose Redis type is not its kind's (_TYPES): a finding
        (``corrupt``, left: no kvstate code wrote it), taken out of ``groups``."""
        s = self.store
        for kind, (want, name) in _TYPES.items():
            keys = groups[kind]
            wrong: set[str] = set()
            for start in range(0, len(keys), BATCH):
                chunk = keys[start : start + BATCH]
                try:
                    types = s.execute([reads.type_of(k) for k in chunk])
                except PermissionDeniedError:
                    if not any("TYPE is not allowed" in n for n in report.notes):
                        report.notes.append(
                            "TYPE is not allowed for this user: keys of the wrong type "
                            "are not named (give the audit the operator user of docs/security.md)"
                        )
                    return
                for key, got in zip(chunk, types, strict=True):
                    if got not in (want, "none"):
                        wrong.add(key)
                        parsed = self.keys.parse_room_key(key)
                        f = Finding(
                            "corrupt",
                            key,
                            f"this {name} is a {got}, not a {want}: "
                            + delete_then_abort(key, parsed),
                            status=WRONG_TYPE,
                        )
                        _locate(f, parsed)
                        f.advice = WRONG_TYPE_HINT.replace(
                            ", then kvstate abort ROOM",
                            "" if f.room is None else f", then kvstate abort {f.room}",
                        )
                        report.findings.append(f)
            groups[kind] = [k for k in keys if k not in wrong]

    # -- checks ------------------------------------------------------------------
    def _no_ttl(self, all_keys: Sequence[str], report: Report) -> None:
        s = self.store
        for start in range(0, len(all_keys), BATCH):
            chunk = all_keys[start : start + BATCH]
            ttls = s.execute([reads.ttl_of(key) for key in chunk])
            for key, ttl in zip(chunk, ttls, strict=True):
                if int(ttl) == -1:
                    f = Finding("no_ttl", key, "key has no TTL: nothing will ever reap it")
                    _locate(f, self.keys.parse_room_key(key))
                    report.findings.append(f)

    def _participants(self, parts: list[StoredParticipant], now: int, report: Report) -> None:
        for p in parts:
            if p.status == WRONG_TYPE:
                f = _about("corrupt", p, f"not a hash: {delete_then_abort(p.key, p.room)}")
                f.advice = WRONG_TYPE_HINT.replace("ROOM", str(p.room))
                report.findings.append(f)
                continue
            bad = [] if not p.valid or p.terminal else p.corrupt_fields
            if not p.valid or bad:
                # the field the time is read from: since_ms once written, else created_ms
                when = schema.SINCE_MS if schema.SINCE_MS in p.fields else schema.CREATED_MS
                what = (
                    f"status {cut_value(p.status)!r} / {when} {cut_value(p.fields.get(when))!r}"
                    if not p.valid
                    else ", ".join(f"{name} {cut_value(p.fields.get(name))!r}" for name in bad)
                )
                report.findings.append(
                    _about(
                        "corrupt",
                        p,
                        f"{what}: the scripts refuse it as corrupt, so no call on it can "
                        f"succeed; kvstate abort {p.room} (or --fix) fails it with the rest "
                        "of its room",
                    )
                )
                continue
            since = p.since_ms
            if since is None:  # a terminal one's: nothing reads it
                continue
            waited = now - since
            if p.terminal:
                if waited > self.grace_ms:
                    report.findings.append(
                        _about(
                            "terminal_uncleared",
                            p,
                            f"{p.status} for {fmt_ms(waited)} and never cleared (grace "
                            f"{fmt_ms(self.grace_ms)}): its owner did not call clear(); "
                            f"TTL reaps it in {fmt_ms(p.pttl_ms)}",
                        )
                    )
                continue
            limit = p.timeout_ms()
            if limit is not None and waited > limit[1]:
                report.findings.append(
                    _about(
                        "stuck",
                        p,
                        f"{p.status} for {fmt_ms(waited)}, past its {limit[0]} timeout of "
                        f"{fmt_ms(limit[1])} (nobody polled it since)",
                    )
                )

    def _dead_engines(self, parts: list[StoredParticipant], report: Report) -> None:
        """Receivers bound to a peer whose lease is gone or whose incarnation changed
        (dead_engine), and participants whose own engine holds no lease (dead_owner):
        nobody will ever move them again. At most one of the two per participant."""
        # already named as stuck or corrupt (their repair fails them); a missing TTL
        # is repaired apart, so it hides nothing (else a second --fix would find more)
        flagged = {f.key for f in report.findings if f.kind != "no_ttl"}
        live = [p for p in parts if p.valid and not p.terminal and p.key not in flagged]
        engines = sorted({e for p in live for e in p.bindings} | {p.engine for p in live})
        if not engines:
            return
        alive = Registry(self.store).incarnations(engines, partial=True)
        unread = set(engines) - set(alive)  # a registration that is no hash: its finding
        for p in live:
            f = None
            for engine, inc in sorted(p.bindings.items()) if p.side == "rx" else []:
                now_inc = alive.get(engine)
                if now_inc == inc or engine in unread:
                    continue
                why = (
                    "has no lease (engine key gone)"
                    if now_inc is None
                    else f"restarted (incarnation {inc} -> {now_inc})"
                )
                f = _about(
                    "dead_engine", p, f"bound to peer {engine} (incarnation {inc}), which {why}"
                )
                f.target = (engine, inc, p.fields.get(schema.PEER_ADDR, ""))
                break
            if f is None and alive.get(p.engine) is None and p.engine not in unread:
                f = _about(
                    "dead_owner",
                    p,
                    f"{p.status} for {fmt_ms(p.in_status_ms)}, but its engine {p.engine} "
                    "holds no lease: nobody will move it again",
                )
            if f is not None:
                report.findings.append(f)

    def _unindexed(self, parts: list[StoredParticipant], report: Report) -> None:
        """Participants missing from their room hash: `kvstate abort` and
        `show` find a room through that index, so they cannot reach these."""
        s = self.store
        k = self.keys
        for start in range(0, len(parts), BATCH):
            chunk = parts[start : start + BATCH]
            # EXISTS and HGET in one transaction (one slot per room): a clear between
            # reading the participant and its index must not read as "unindexed"
            calls = []
            for p in chunk:
                calls += [reads.exists(p.key), reads.listed(s.keys, p.room, p.side, p.engine)]
            raw = s.execute(calls, transaction=True, partial=True)
            for i, p in enumerate(chunk):
                if isinstance(raw[2 * i + 1], KVStateError):
                    continue  # the room hash is not a hash: a finding of its own
                if int(raw[2 * i]) and not int(raw[2 * i + 1]):
                    f = _about(
                        "unindexed",
                        p,
                        f"not in {k.room_hash(p.room)} (the hash expired before the "
                        "participant, or a clear was cut short): abort and show "
                        "cannot reach it",
                    )
                    report.findings.append(f)

    def _trackers(self, trackers: Sequence[str], report: Report) -> None:
        s = self.store
        if not trackers:
            return
        members_raw = s.execute([reads.members_of(t) for t in trackers], partial=True)
        pairs = [
            (t, m.decode("utf-8", "replace"))
            for t, ms in zip(trackers, members_raw, strict=True)
            if not isinstance(ms, KVStateError)  # not a sorted set: a finding of its own
            for m in ms
        ]
        for start in range(0, len(pairs), BATCH):
            chunk = pairs[start : start + BATCH]
            keys = [self.keys.tracked_key(m) for _, m in chunk]
            exists = iter(s.execute([reads.exists(k) for k in keys if k is not None]))
            for (tracker, member), key in zip(chunk, keys, strict=True):
                if key is not None and int(next(exists)):
                    continue
                f = Finding(
                    "orphan_tracker",
                    tracker,
                    f"member {member!r} names a receiver that is gone "
                    "(a clear interrupted between the room and the tracker)",
                )
                _locate(f, None if key is None else self.keys.parse_room_key(key))
                f.target = (member,)
                report.findings.append(f)

    def _room_data(self, rooms: Sequence[str], report: Report) -> None:
        """Transfer infos and acks in a room hash that no clear will take: an info whose
        sender and receiver are both gone and unlisted, acks whose receiver is. (A
        receiver may publish before its sender exists: its own clear takes the info.)"""
        s = self.store
        for start in range(0, len(rooms), BATCH):
            chunk = [p for x in rooms[start : start + BATCH] if (p := self.keys.parse_room_key(x))]
            read = s.execute([reads.room_fields(s.keys, p.room) for p in chunk], partial=True)
            orphans: list[tuple[RoomKey, str, list[tuple[Side, str]]]] = []
            hashes: list[tuple[RoomKey, dict[str, Any]]] = []
            for p, fields in zip(chunk, read, strict=True):
                if isinstance(fields, KVStateError):
                    continue  # not a hash: no_ttl / the operator's look, not this check
                hashes.append((p, fields))
                for name in sorted(fields):
                    owners = schema.clear_owners(name)
                    if owners and not any(schema.member(*o) in fields for o in owners):
                        orphans.append((p, name, owners))
            self._stale_members(hashes, report)
            exists = s.execute(
                [
                    reads.exists(self.keys.participant(p.room, *o))
                    for p, _, owners in orphans
                    for o in owners
                ]
            )
            at = 0
            for p, name, owners in orphans:
                found = [int(n) for n in exists[at : at + len(owners)]]
                at += len(owners)
                if any(found):
                    continue
                who = " and ".join(f"{side}:{engine}" for side, engine in owners)
                f = Finding(
                    "unclaimed_xfer",
                    p.key,
                    f"field {name!r} names {who}, none of which exists or is in the "
                    "room: no clear will take it (its TTL is the room's)",
                    room=p.room,
                    engine=owners[0][1],
                )
                f.target = (name,)
                report.findings.append(f)

    def _stale_members(self, rooms: list[tuple[RoomKey, dict[str, Any]]], report: Report) -> None:
        """Members of a room hash whose participant hash is gone: ``show`` marks them
        red, ``abort`` finds nothing to fail there, and no clear will take them. One
        batch of EXISTS for the rooms given."""
        s = self.store
        listed = [
            (p, fields, m)
            for p, fields in rooms
            for name in sorted(fields)
            if (m := schema.parse_member(name)) is not None
        ]
        keys = [self.keys.participant(p.room, m.side, m.engine) for p, _, m in listed]
        found = s.execute([reads.exists(k) for k in keys]) if keys else []
        for (p, fields, m), key, n in zip(listed, keys, found, strict=True):
            if int(n):
                continue
            name = schema.member(m.side, m.engine)
            f = Finding(
                "stale_member",
                p.key,
                f"lists {name}, whose hash {key} is gone (deleted, or expired while the "
                "room hash was kept alive): abort finds nothing to fail there and no "
                "clear will take the listing",
                room=p.room,
                side=m.side,
                engine=m.engine,
            )
            f.target = (name, *schema.cleared_by(m.side, m.engine, fields))
            report.findings.append(f)


__all__ = ["DEFAULT_GRACE", "Auditor", "Finding", "Report", "acl_refused"]
