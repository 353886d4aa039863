"""Every exception kvstate raises, in one tree with one base, so callers can catch it
all (``KVStateError``), and every class is importable from ``kvstate``.

The one family outside the base, on purpose: the transports' (``TransportError`` and
its ``LayoutError``, ``CMAError``, ``PtracerError``), because ``transports/`` never
imports ``kvstate``; they are re-exported here. (``kvstate.store.deadline`` has a
redis-py ``TimeoutError`` of its own for redis-py's retry loop; the store translates
it, so it never reaches a caller.)

Messages name what was wrong and what to do next; none ever carries a password.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transports.base import LayoutError, TransportError
    from transports.cma import CMAError, PtracerError

# Re-exported on first use (PEP 562): the transports import numpy, which the CLI's
# views never need (issue 31: start-up per call).
_TRANSPORTS = {
    "LayoutError": "transports.base",
    "TransportError": "transports.base",
    "CMAError": "transports.cma",
    "PtracerError": "transports.cma",
}


def __getattr__(name: str) -> Any:
    module = _TRANSPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


class KVStateError(Exception):
    """Base class of every kvstate error."""


class InvalidRoomError(KVStateError, ValueError):
    """A room id that is not an integer in [0, 2**63)."""


class InvalidStatusError(KVStateError, ValueError):
    """A status that is not a KVPoll member."""


class InvalidNameError(KVStateError, ValueError):
    """A namespace, engine id or address with characters a key cannot carry."""


class InvalidIndicesError(KVStateError, ValueError):
    """A page-index array that is not 1-D non-negative integers that fit the buffers."""


class InvalidURLError(KVStateError, ValueError):
    """A Redis URL kvstate cannot use."""


class InvalidValueError(KVStateError, ValueError):
    """An argument out of its range (a role, a count of receivers or senders...)."""


class InvalidOptionError(KVStateError, ValueError):
    """An option or parameter out of its range (an ``Options`` field, ``room_ttl``...)."""


class ClosedError(KVStateError):
    """A ``Store`` (or what was made on it) used after its ``close()``."""


class ManagerClosedError(ClosedError):
    """A ``KVManager`` (or one of its senders or receivers) used after its ``close()``."""


class NotReadyError(KVStateError):
    """A call made before the room is ready for it (``begin_transfer()`` before every
    required receiver bound and published, ``finish_transfer()`` before
    ``begin_transfer()``); nothing was written: wait for the status it names."""


class StateConnectionError(KVStateError, ConnectionError):
    """Redis could not be reached or refused us (auth, ACL); the URL in it is redacted.
    ``may_have_run``: the request was written before the connection failed, so Redis
    may have run it and only its reply was lost (every kvstate call can be made again)."""

    may_have_run: bool = False


class AuthenticationFailedError(StateConnectionError):
    """Redis refused the password, or asks for one that was not given: no retry mends
    it (``kvstate monitor`` waits for a Redis that is down, not for this)."""


class PermissionDeniedError(StateConnectionError):
    """Redis refused a command under its ACL (NOPERM): a user with more rights is
    needed; retrying does not help. A StateConnectionError, as every refusal is."""


class DurabilityError(StateConnectionError):
    """Durable mode: Redis applied the write, but no replica confirmed it (``WAIT``)
    within the call's time; a failover of that primary could still lose it."""


class StateOutOfMemoryError(KVStateError):
    """Redis is at maxmemory (noeviction) and refused a write; clearing still works."""


class InvalidArgumentError(KVStateError, TypeError):
    """A value Redis cannot store (e.g. a reason that is not text), refused before sending."""


class CorruptStateError(KVStateError):
    """A stored value that does not decode; names the key and field so it can be inspected."""

    def __init__(self, key: str, field: str, detail: str) -> None:
        self.key = key
        self.field = field
        super().__init__(
            f"corrupt state in {key!r} field {field!r}: {detail} "
            f"(inspect with: redis-cli HGET {key} {field}; `kvstate abort` fails the room)"
        )


class PeerNotFoundError(KVStateError, LookupError):
    """No live engine is registered at a bootstrap address."""


class EngineNameTakenError(KVStateError):
    """Another live process holds this engine name: one owner per name."""

    def __init__(
        self, engine: str, holder: str, host: str, pid: str, namespace: str, what: str = ""
    ) -> None:
        self.engine, self.holder, self.host, self.pid = engine, holder, host, pid
        super().__init__(
            f"{what or 'engine name'} {engine!r} in namespace {namespace!r} is held by a live "
            f"process (host {host or '?'}, pid {pid or '?'}, incarnation {holder}): give this "
            "rank its own engine name, or stop that process first (its name is free once "
            "its lease lapses)"
        )


class ForkedManagerError(KVStateError):
    """A KVManager (or its participants) used in a process forked from its owner."""


class KVTransferError(KVStateError):
    """A room that failed; carries the reason recorded in Redis."""

    def __init__(self, room: int, reason: str) -> None:
        self.room = room
        self.reason = reason
        super().__init__(f"room {room} failed: {reason}")


class DurationSyntaxError(KVStateError, ValueError):
    """Text that is not a duration; the message says what to write instead."""


class RedisServerError(KVStateError, RuntimeError):
    """A redis-server could not be found, started, or brought to the wanted state
    (``connect("embedded")`` raises it)."""


class MetricsPortError(KVStateError):
    """The metrics port cannot be bound (taken, or not allowed)."""


class UnsupportedConfigError(KVStateError, ValueError):
    """A serving stack's setting or shape that kvstate's backend for it refuses at
    start-up, named in the message with what to use instead."""


class UnsupportedSGLangError(UnsupportedConfigError):
    """The installed SGLang is not a release the SGLang backend was tested with."""


class UnsupportedLayoutError(UnsupportedConfigError):
    """A parallel layout or buffer set the SGLang backend refuses."""


class VLLMConfigError(UnsupportedConfigError):
    """A vLLM setting kvstate's connector cannot work with."""


class LayoutRefusedError(VLLMConfigError):
    """vLLM handed the connector KV caches kvstate cannot move byte for byte."""


__all__ = [
    "AuthenticationFailedError",
    "CMAError",
    "ClosedError",
    "CorruptStateError",
    "DurabilityError",
    "DurationSyntaxError",
    "EngineNameTakenError",
    "ForkedManagerError",
    "InvalidArgumentError",
    "InvalidIndicesError",
    "InvalidNameError",
    "InvalidOptionError",
    "InvalidRoomError",
    "InvalidStatusError",
    "InvalidURLError",
    "InvalidValueError",
    "KVStateError",
    "KVTransferError",
    "LayoutError",
    "LayoutRefusedError",
    "ManagerClosedError",
    "MetricsPortError",
    "NotReadyError",
    "PeerNotFoundError",
    "PermissionDeniedError",
    "PtracerError",
    "RedisServerError",
    "StateConnectionError",
    "StateOutOfMemoryError",
    "TransportError",
    "UnsupportedConfigError",
    "UnsupportedLayoutError",
    "UnsupportedSGLangError",
    "VLLMConfigError",
]
