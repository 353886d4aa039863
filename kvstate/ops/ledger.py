"""The leak ledger: ``kvstate:<ns>:ledger``, a stream of which participants were reaped
by TTL (never cleared), with the last status anyone saw, plus what the audit cleaned.
Capped with ``XADD MAXLEN ~ 10000``, its 7-day TTL refreshed by each append (design
rule 1: every key has a TTL, even the long-lived ones). ``kvstate.ops.monitor`` fills
it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstate import schema
from kvstate.store import Store, command_call

log = logging.getLogger(__name__)
LEDGER_MAXLEN = 10_000
LEDGER_TTL_MS = 7 * 24 * 3600 * 1000
ENTRY_FIELDS = schema.LEDGER_FIELDS  # the stream's fields: Entry's attributes of those names


@dataclass(frozen=True)
class Entry:
    """One ledger line. ``event`` is ``expired`` (reaped by TTL) or ``audit:<kind>``."""

    event: str
    room: int | None
    side: str
    engine: str
    status: str
    age_ms: int | None
    key: str
    detail: str = ""
    id: str = ""

    def flat(self) -> list[Any]:
        out: list[Any] = []
        for name in ENTRY_FIELDS:
            value = getattr(self, name)
            out += [name, "" if value is None else value]
        return out

    @classmethod
    def parse(cls, entry_id: bytes, raw: dict[bytes, bytes]) -> Entry:
        h = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
        room, age = h.get("room", ""), h.get("age_ms", "")
        return cls(
            event=h.get("event", ""),
            room=int(room) if room.isascii() and room.isdigit() and len(room) < 20 else None,
            side=h.get("side", ""),
            engine=h.get("engine", ""),
            status=h.get("status", ""),
            age_ms=int(age) if age.lstrip("-").isdigit() else None,
            key=h.get("key", ""),
            detail=h.get("detail", ""),
            id=entry_id.decode(),
        )

    @property
    def at_ms(self) -> int | None:
        """When it was recorded (server clock: the stream id's time part)."""
        head = self.id.partition("-")[0]
        return int(head) if head.isdigit() else None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("id", "at_ms", *ENTRY_FIELDS)}


class Ledger:
    """Appends to and reads the namespace's ledger stream."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.key = store.keys.ledger

    def append(self, entries: Sequence[Entry]) -> None:
        """XADD each entry (capped near LEDGER_MAXLEN) and refresh the stream's TTL, in
        one transaction."""
        calls = [
            command_call("XADD", self.key, args=["MAXLEN", "~", LEDGER_MAXLEN, "*", *e.flat()])
            for e in entries
        ]
        if calls:
            ttl = command_call("PEXPIRE", self.key, args=[LEDGER_TTL_MS])
            self.store.execute([*calls, ttl], transaction=True)

    def recent(self, count: int = 10) -> list[Entry]:
        """The newest ``count`` entries, newest first."""
        newest = command_call("XREVRANGE", self.key, args=["+", "-", "COUNT", count])
        raw = self.store.execute([newest])[0]
        return [Entry.parse(i, h) for i, h in raw]


__all__ = ["ENTRY_FIELDS", "LEDGER_MAXLEN", "LEDGER_TTL_MS", "Entry", "Ledger"]
