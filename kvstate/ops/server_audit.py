"""The audit's server-level checks: settings that put room state at risk (an eviction
policy) and kvstate's FUNCTION libraries that nobody uses or that hold other code.
Findings of a server, not of a room: kept apart from the room checks in audit.py."""

from __future__ import annotations

from kvstate.errors import KVStateError, PermissionDeniedError, StateConnectionError
from kvstate.ops.findings import Finding, Report
from kvstate.ops.libraries import survey
from kvstate.store import Store


def server_findings(store: Store, report: Report) -> None:
    """What the server's settings and its FUNCTION libraries say, on every primary."""
    for name in store.primaries():
        try:
            policy = store.eviction_policy(name)
        except PermissionDeniedError:
            report.notes.append(
                f"{name}: INFO is not allowed for this user; eviction policy not "
                "checked (give the audit a user with +info)"
            )
            continue
        except StateConnectionError:
            raise
        except KVStateError as exc:  # refused otherwise (a renamed command...)
            report.notes.append(f"{name}: INFO failed ({exc}); eviction policy not checked")
            continue
        if policy and policy != "noeviction":
            report.findings.append(
                Finding(
                    "server_setting",
                    name,
                    f"maxmemory-policy is {policy}: Redis may evict room state under memory "
                    "pressure (volatile-* evicts exactly the keys with a TTL: all of "
                    "kvstate's); "
                    "set it to noeviction",
                )
            )
    _libraries(store, report)


def _libraries(store: Store, report: Report) -> None:
    """kvstate's FUNCTION libraries that nobody uses (issue 31): server-wide, left
    by an older kvstate; removing them is an admin's step."""
    try:
        found = survey(store)
    except PermissionDeniedError:
        report.notes.append(
            "FUNCTION LIST is not allowed for this user: kvstate's libraries not "
            "checked (add +function|list on Redis 7)"
        )
        return
    report.notes += found.notes
    for lib in found.libraries:
        if lib.forged:
            report.findings.append(
                Finding(
                    "foreign_library",
                    lib.node,
                    f"the library {lib.name}, named as this kvstate's, holds other code "
                    "(loaded by someone else first, or replaced): engines do not run it "
                    "(EVALSHA instead); someone could FUNCTION LOAD, which no tenant's "
                    "user should",
                    target=(lib.name,),
                )
            )
        elif lib.stale(found.unknown):
            report.findings.append(
                Finding(
                    "stale_library",
                    lib.node,
                    f"the library {lib.name} (kvstate {lib.version}) is used by no live "
                    "engine and not by this kvstate",
                    target=(lib.name,),
                )
            )
