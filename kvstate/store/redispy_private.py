"""The redis-py names outside its public API that kvstate relies on, all in one place.

The lean round trip (kvstate.store.wire) reads replies straight from a connection's hiredis
reader, and kvstate.store.connection cuts each socket wait to the call's deadline; both need
names redis-py does not promise to keep (underscored, or attributes its documentation
does not name). Only this module touches them, through the small functions below, and
``PRIVATE`` lists each one (where it lives, what kvstate uses it for): ``missing()``
checks the installed redis-py against that list, and tests/test_redis_seam.py fails
naming any symbol a redis-py release moved. pyproject.toml pins redis-py to the major
versions that passed it.
"""

from __future__ import annotations

import importlib
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.retry import Retry

# The parser redis-py gives a connection when hiredis is installed, and the sentinel its
# reader returns while a reply is incomplete. In another layout the lean round trip reads
# through read_response instead (slower, same replies).
NOT_ENOUGH_DATA: object | None
_HIREDIS_PARSER: Any  # a class, or None
try:
    from redis._parsers import hiredis as _hiredis

    NOT_ENOUGH_DATA = _hiredis.NOT_ENOUGH_DATA
    _HIREDIS_PARSER = _hiredis._HiredisParser
except (ImportError, AttributeError):  # pragma: no cover - caught by missing()
    NOT_ENOUGH_DATA = None
    _HIREDIS_PARSER = None

_HIREDIS = "redis._parsers.hiredis"
_PARSER = f"{_HIREDIS}:_HiredisParser"
_CONN = "redis.connection:AbstractConnection"


@dataclass(frozen=True)
class Private:
    """One name kvstate uses that redis-py may move in any release."""

    owner: str  # a module ("redis._parsers.hiredis") or "module:Class"
    name: str
    used_for: str
    instance: bool = False  # an attribute each instance sets (checked on a sample one)

    @property
    def symbol(self) -> str:
        """The dotted name a failure reports, e.g. ``redis.connection.Connection._connect``."""
        return f"{self.owner.replace(':', '.')}.{self.name}"


PRIVATE: tuple[Private, ...] = (
    Private(_HIREDIS, "NOT_ENOUGH_DATA", "what a hiredis reader returns for an incomplete reply"),
    Private(_HIREDIS, "_HiredisParser", "a connection's parser when hiredis is installed"),
    Private(_PARSER, "_reader", "the parser's hiredis.Reader, made on connect", instance=True),
    Private(_PARSER, "read_from_socket", "reads what the socket has into that reader"),
    Private(_CONN, "_parser", "a connection's parser", instance=True),
    Private(_CONN, "_sock", "a connection's socket, its timeout cut to the deadline", True),
    Private(_CONN, "_host_error", "the host a connection error names"),
    Private(_CONN, "retry", "the retry policy a lean round trip runs under", instance=True),
    Private(_CONN, "next_health_check", "postponed by a lean read, as by read_response", True),
    Private("redis.connection:Connection", "_connect", "opens a TCP socket (deadline-bound)"),
    Private("redis.connection:SSLConnection", "_connect", "opens a TLS socket (deadline-bound)"),
    Private("redis.connection:UnixDomainSocketConnection", "_connect", "opens a unix socket"),
)


# --------------------------------------------------------------------------- the seam

Reader = Any  # hiredis.Reader (untyped)


def hiredis_reader(conn: Any) -> tuple[Reader, Callable[[], object]] | None:
    """The connected ``conn``'s hiredis reader and the call that reads more from its
    socket into it (whose ``gets()`` returns NOT_ENOUGH_DATA until a reply is whole);
    None when its parser is not hiredis's: read through ``read_response`` then."""
    parser = conn._parser
    reader = getattr(parser, "_reader", None)
    if reader is None or _HIREDIS_PARSER is None or not isinstance(parser, _HIREDIS_PARSER):
        return None
    return reader, parser.read_from_socket


def host_error(conn: Any) -> str:
    """The host ``conn`` talks to, as redis-py names it in its own error messages."""
    return str(conn._host_error())


def retry_of(conn: Any) -> Retry:
    """The retry policy of ``conn`` (its client's, kvstate.store.connection's bounded one)."""
    retry: Retry = conn.retry
    return retry


def read_succeeded(conn: Any) -> None:
    """After replies were read without ``read_response``: the next health check moves on
    by the interval, as redis-py's own read does (a busy connection is not PINGed)."""
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval


def socket_of(conn: Any) -> socket.socket | None:
    """The socket of ``conn``; None while not connected."""
    sock: socket.socket | None = conn._sock
    return sock


def connect_over(conn: Any, sock: socket.socket) -> None:
    """Connect ``conn`` over ``sock``, already open, as its own connect would (without
    the handshake): how the check below and the tests get a connection without a server."""
    conn._sock = sock
    conn._parser.on_connect(conn)


class SocketOpener:
    """Base of a mixin into redis-py's connection classes: redis-py opens a connection's
    socket in its private ``_connect``; this sends that through ``open_socket(connect)``,
    which the mixin overrides (kvstate.store.connection: connect under the call's deadline)."""

    def _connect(self) -> Any:
        return self.open_socket(super()._connect)  # type: ignore[misc]

    def open_socket(self, connect: Callable[[], Any]) -> Any:
        return connect()


# --------------------------------------------------------------------------- the check


def _resolve(owner: str) -> Any:
    module, _, cls = owner.partition(":")
    found: Any = importlib.import_module(module)
    return getattr(found, cls) if cls else found


_CONNECTION_CLASS: Any = redis.Connection


def _connection() -> Any:
    """A connection as redis-py makes it, never connected."""
    return _CONNECTION_CLASS()


def _connected_parser() -> Any:
    """The hiredis parser of a connection, connected over a local socket pair (no
    server): what ``on_connect`` sets on it."""
    conn = _CONNECTION_CLASS(parser_class=_resolve(_PARSER))
    mine, other = socket.socketpair()
    try:
        connect_over(conn, mine)
        return conn._parser
    finally:
        mine.close()
        other.close()


# How to get an instance of each owner with instance attributes in PRIVATE.
_SAMPLES: dict[str, Callable[[], Any]] = {_CONN: _connection, _PARSER: _connected_parser}


def missing(names: Iterable[Private] = PRIVATE) -> list[str]:
    """The symbols of ``names`` the installed redis-py lacks (none: the seam holds)."""
    gone: list[str] = []
    for private in names:
        owner = private.owner
        try:
            found = _SAMPLES[owner]() if private.instance else _resolve(owner)
        except (ImportError, AttributeError, KeyError):
            gone.append(private.symbol)
            continue
        if not hasattr(found, private.name):
            gone.append(private.symbol)
    return gone


__all__ = [
    "NOT_ENOUGH_DATA",
    "PRIVATE",
    "Private",
    "SocketOpener",
    "connect_over",
    "host_error",
    "hiredis_reader",
    "missing",
    "read_succeeded",
    "retry_of",
    "socket_of",
]
