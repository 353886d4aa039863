"""kvstate's FUNCTION libraries on a server: which are there, who uses them, which are
stale (issue 31: functions have a lifecycle).

On Redis 7 every kvstate version leaves one server-wide library, ``kvstate_<hash>``
(kvstate.store.functions), that outlives the engines that used it. An engine records
its kvstate's library in its registration (``schema.LIBRARY``), so a library is in use
while a live registration, in any namespace, names it, and stale when it is neither
this kvstate's nor named by any. Removing one that an engine still uses costs that
engine nothing but speed: its next FCALL meets "Function not found" and it takes the
EVAL path (or loads it again, where its user may). Who may read what decides how
sure the answer is: a registration the user may not read (another namespace's, under
a confined ACL) or one written by a kvstate that did not record its library makes
every other library "maybe in use" (``unknown``), and nothing is called stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstate import schema
from kvstate.errors import KVStateError, PermissionDeniedError
from kvstate.keys import Keys, namespace_of
from kvstate.store import LIBRARY_NAME, LIBRARY_VERSION, Store, command_call, text_or_none

BATCH = 500


@dataclass
class LibraryState:
    """One library on one primary, and who uses it."""

    node: str
    name: str
    version: str
    current: bool  # this kvstate's library, with its exact code
    forged: bool  # named as this kvstate's library, but holding other code
    engines: int = 0  # live registrations (every namespace readable) that name it

    def stale(self, unknown: int) -> bool:
        """Nobody uses it: not this kvstate's, no live engine names it, and no engine
        that could be using it went unread (``unknown``)."""
        return not self.current and not self.forged and self.engines == 0 and unknown == 0

    def to_json(self, unknown: int) -> dict[str, Any]:
        return {
            "node": self.node,
            "name": self.name,
            "version": self.version,
            "current": self.current,
            "forged": self.forged,
            "engines": self.engines,
            "stale": self.stale(unknown),
        }


@dataclass
class Survey:
    """The libraries of every primary. ``unknown``: live registrations whose library
    could not be told (unreadable by this user, or written by an older kvstate).
    ``no_function``: primaries without FUNCTION (Redis 6.2): nothing to list there."""

    libraries: list[LibraryState] = field(default_factory=list)
    unknown: int = 0
    no_function: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def stale(self) -> list[LibraryState]:
        return [lib for lib in self.libraries if lib.stale(self.unknown)]

    def to_json(self) -> dict[str, Any]:
        return {
            "current": LIBRARY_NAME,
            "version": LIBRARY_VERSION,
            "libraries": [lib.to_json(self.unknown) for lib in self.libraries],
            "engines_unknown": self.unknown,
            "no_function": self.no_function,
            "notes": self.notes,
        }


def engine_libraries(store: Store) -> tuple[dict[str, int], int, list[str]]:
    """(library -> live registrations naming it, registrations whose library is unknown,
    notes) over every namespace of the server: SCAN of every registration, then its
    ``library`` field, a namespace at a time (a namespace this user may not read counts
    as unknown, with a note)."""
    by_ns: dict[str, list[str]] = {}
    for key in store.scan(Keys.every_engine_pattern()):
        ns = namespace_of(key)
        if ns is not None and key.startswith(Keys(ns).engine("")):
            by_ns.setdefault(ns, []).append(key)
    used: dict[str, int] = {}
    unknown, notes = 0, []
    for ns, keys in sorted(by_ns.items()):
        for start in range(0, len(keys), BATCH):
            chunk = keys[start : start + BATCH]
            try:
                raw = store.execute(
                    [
                        command_call("HMGET", k, args=[schema.INCARNATION, schema.LIBRARY])
                        for k in chunk
                    ],
                    partial=True,
                )
            except PermissionDeniedError:
                unknown += len(keys) - start
                notes.append(
                    f"namespace {ns}: this user may not read its {len(keys)} engine "
                    "registration(s), so which libraries they use is unknown"
                )
                break
            for value in raw:
                if isinstance(value, KVStateError) or value[0] is None:
                    continue  # not a hash (no engine of ours), or gone meanwhile
                if value[1]:
                    name = text_or_none(value[1]) or ""
                    used[name] = used.get(name, 0) + 1
                else:  # registered by a kvstate that did not record its library
                    unknown += 1
    return used, unknown, notes


def survey(store: Store) -> Survey:
    """kvstate's libraries on every primary and who uses them. PermissionDeniedError
    where the user may not FUNCTION LIST."""
    out = Survey()
    for node in store.primaries():
        found = store.libraries(node)
        if found is None:
            out.no_function.append(node)
            continue
        for lib in found:
            out.libraries.append(
                LibraryState(
                    node,
                    lib.name,
                    lib.version,
                    lib.current,
                    forged=lib.name == LIBRARY_NAME and not lib.current,
                )
            )
    if out.libraries:
        used, out.unknown, out.notes = engine_libraries(store)
        for state in out.libraries:
            state.engines = used.get(state.name, 0)
        if out.unknown:
            out.notes.append(
                f"{out.unknown} live engine(s) did not say which library they use (another "
                "namespace's, unreadable here, or registered by a kvstate that did not "
                "record it): no library is called stale"
            )
    return out
