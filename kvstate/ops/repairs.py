"""The audit's repairs (``kvstate audit --fix``): each finding kind that has one, only
what cannot hurt a live request (kvstate.ops.findings says which), every repair
appended to the ledger. A repair whose target went away or moved on meanwhile is
``resolved``, not left. Repairs that write give the key the room's remaining TTL (the
longest left on its index and participants), never a fresh default, so a room does not
end with mixed TTLs."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from kvstate import schema
from kvstate.errors import CorruptStateError, KVStateError
from kvstate.ops import reads
from kvstate.ops.durations import fmt_ms
from kvstate.ops.findings import Finding, Report, acl_refused, delete_then_abort
from kvstate.ops.findings import kind as finding_kind
from kvstate.ops.ledger import LEDGER_TTL_MS, Entry, Ledger
from kvstate.ops.views import WRONG_TYPE
from kvstate.poll import KVPoll
from kvstate.store import Status, Store


class Repairs:
    """Repairs the findings of one audit report, in one namespace."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    def fix(self, report: Report) -> None:
        """Repair what is safe to; say for each finding what was done or why not."""
        done: list[Finding] = []
        # re-index first: an abort (the repair of a corrupt participant) reaches a room's
        # participants through its index
        for f in sorted(report.findings, key=lambda f: f.kind != "unindexed"):
            try:
                self._fix_one(f)
            except KVStateError as exc:
                f.left = f"fix failed: {exc}"
            if f.fixed:
                done.append(f)
        entries = [
            Entry(
                f"audit:{f.kind}",
                f.room,
                f.side,
                f.engine,
                f.status or "",
                f.age_ms,
                f.key,
                f.fixed,
            )
            for f in done
        ]
        try:
            Ledger(self.store).append(entries)
        except CorruptStateError as exc:  # the ledger is not a stream: its own finding
            report.notes.append(f"the repairs above are not recorded in the ledger ({exc})")
        except KVStateError as exc:
            if not acl_refused(exc):
                raise
            report.notes.append(
                "XADD is not allowed for this user: the repairs above are not "
                "recorded in the ledger"
            )

    def _room_ttl_ms(self, room: int, also: Sequence[str] = ()) -> int:
        """The longest TTL left on the room hash, its listed participants and
        ``also``: what a repair gives the keys it writes. The store's TTL (--room-ttl)
        only when none of them has one."""
        return self._room_ttl(room, also)[0]

    def _room_ttl(self, room: int, also: Sequence[str] = ()) -> tuple[int, bool]:
        """(``_room_ttl_ms``, whether it is the room's: False when no key of the room
        has a TTL and it is the store's, --room-ttl)."""
        s = self.store
        k = self.keys
        keys = [k.room_hash(room), *also]
        keys += [k.participant(room, *p) for m in s.members(room) if (p := schema.parse_member(m))]
        ttls = [int(t) for t in s.execute([reads.ttl_of(key) for key in keys]) if int(t) > 0]
        return (max(ttls), True) if ttls else (s.ttl_ms, False)

    def _store_for(self, room: int | None, also: Sequence[str] = ()) -> Store:
        """The store, with the room's remaining TTL as the TTL its scripts write."""
        if room is None:
            return self.store
        view = copy.copy(self.store)
        view.room_ttl = self._room_ttl_ms(room, also) / 1000
        return view

    def _fix_one(self, f: Finding) -> None:
        """Repair one finding by its kind (``_fix_<kind>``); the findings table says which
        kinds have a repair, and tests/test_findings.py keeps the two in step."""
        kind = finding_kind(f.kind)
        if kind.fixable:
            getattr(self, f"_fix_{kind.name}")(f)
        else:
            f.left = kind.left_for(f.room)

    def _fix_no_ttl(self, f: Finding) -> None:
        s = self.store
        if f.key == self.keys.ledger:
            ttl, why = LEDGER_TTL_MS, " (the ledger's)"
        elif f.room is not None:
            ttl, room_s = self._room_ttl(f.room)
            why = (
                " (the room's remaining TTL)"
                if room_s
                else " (--room-ttl: no key of the room has a TTL to match)"
            )
        else:
            ttl, why = s.ttl_ms, " (--room-ttl)"
        now = int(s.execute([reads.ttl_of(f.key)])[0])
        if now != -1:  # only keys that still have no TTL
            f.resolved = (
                "it is gone" if now == -2 else f"it got a TTL meanwhile ({fmt_ms(now)} left)"
            )
            return
        s.execute([reads.expire(f.key, ttl)])
        f.fixed = f"set a TTL of {fmt_ms(ttl)}{why}"

    def _fix_stuck(self, f: Finding) -> None:
        s = self.store
        assert f.room is not None
        st: Status = s.execute([self._store_for(f.room).poll(f.room, *f.part)])[0]
        if st.status == KVPoll.Failed:
            f.fixed = f"failed it: {st.reason}"
        else:
            f.resolved = f"it moved on ({st.status.name if st.status else 'gone'})"

    def _fix_orphan_tracker(self, f: Finding) -> None:
        s = self.store
        (member,) = f.target
        n = s.execute([reads.untrack(f.key, member)])[0]
        if int(n):
            f.fixed = f"removed {member} from the tracker"
        else:
            f.resolved = "the member was removed meanwhile"

    def _fix_unclaimed_xfer(self, f: Finding) -> None:
        s = self.store
        assert f.room is not None
        (name,) = f.target
        owners = schema.clear_owners(name)
        keys = [s.keys.participant(f.room, *o) for o in owners]
        if any(int(n) for n in s.execute([reads.exists(k) for k in keys])):
            f.resolved = "a participant it names appeared meanwhile"
        elif int(s.execute([reads.drop_room_fields(s.keys, f.room, name)])[0]):
            f.fixed = f"deleted the field {name!r}"
        else:
            f.resolved = "the field was deleted meanwhile"

    def _fix_dead_engine(self, f: Finding) -> None:
        s = self.store
        engine, inc, addr = f.target
        reason = (
            f"peer {engine} at {addr or '?'} is gone (incarnation {inc}); failed by kvstate audit"
        )
        view = self._store_for(f.room)
        n = s.execute([view.fail_receiver(f.key, engine, inc, reason)])[0]
        if int(n):
            f.fixed = f"failed it: {reason}"
        else:
            f.resolved = "it reached a terminal status or was cleared meanwhile"

    def _fix_dead_owner(self, f: Finding) -> None:
        s = self.store
        assert f.room is not None
        reason = f"engine {f.engine} lost its lease; failed by kvstate audit"
        view = self._store_for(f.room)
        call = view.update(f.room, *f.part, KVPoll.Failed, reason)
        st2: Status = s.execute([call])[0]
        if st2.status == KVPoll.Failed and st2.reason == reason:
            f.fixed = f"failed it: {reason}"
        else:
            f.resolved = f"it moved on ({st2.status.name if st2.status else 'gone'})"

    def _fix_corrupt(self, f: Finding) -> None:
        """Abort the room: abort.lua fails a garbage status like any other (no poll of it
        could ever succeed, so its room cannot finish). A key of the wrong type was not
        written by kvstate: that one needs an operator's look first."""
        if f.status == WRONG_TYPE:
            f.left = delete_then_abort(f.key, f.room)
            return
        assert f.room is not None
        n = self._store_for(f.room).abort(
            f.room, f"{f.side}:{f.engine} held a corrupt status; failed by kvstate audit"
        )
        f.fixed = f"aborted room {f.room}: {n} participant(s) failed"

    def _fix_stale_member(self, f: Finding) -> None:
        """Drop the listing (and the fields the participant's own clear would have
        taken), after a fresh look that its hash is still gone. (A participant of that
        engine created for the room in between, a reused room id, would lose its
        listing: the next audit names it ``unindexed`` and --fix lists it again.)"""
        s = self.store
        assert f.room is not None
        key = self.keys.participant(f.room, *f.part)
        if int(s.execute([reads.exists(key)])[0]):
            f.resolved = "its participant appeared meanwhile"
            return
        dropped = s.execute([reads.drop_room_fields(s.keys, f.room, *f.target)])[0]
        if int(dropped):
            extra = len(f.target) - 1
            f.fixed = f"removed {f.target[0]} from the room hash" + (
                f" with {extra} field(s) its clear would have taken" if extra else ""
            )
        else:
            f.resolved = "the listing was removed meanwhile"

    def _fix_unindexed(self, f: Finding) -> None:
        s = self.store
        assert f.room is not None
        side, engine = f.part
        member = schema.member(side, engine)
        exists = s.execute([reads.exists(f.key)])[0]
        if not int(exists):
            f.resolved = "it was cleared meanwhile"
            return
        ttl = self._room_ttl_ms(f.room, also=[f.key])
        s.execute(
            [
                reads.relist(s.keys, f.room, side, engine),
                reads.expire(self.keys.room_hash(f.room), ttl),
            ],
            transaction=True,
        )
        f.fixed = f"added {member} back to the room's index (TTL {fmt_ms(ttl)})"


__all__ = ["Repairs"]
