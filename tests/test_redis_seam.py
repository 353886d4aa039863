"""The redis-py seam (kvstate/store/redispy_private.py): every name kvstate uses outside
redis-py's public API is where kvstate expects it in the installed redis-py, and the
seam's functions do what kvstate.store.wire and kvstate.store.connection need of them. No server:
a local socket pair stands in for one (fast tier)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis
from redis.retry import Retry

from kvstate.store import redispy_private as private
from kvstate.store.deadline import BoundedPool, DeadlineBoundConnection, DeadlineExceeded, deadline


def test_every_private_name_is_where_kvstate_expects_it() -> None:
    gone = private.missing()
    assert not gone, (
        f"redis-py {redis.__version__} moved what kvstate relies on: {', '.join(gone)} "
        "(see kvstate/store/redispy_private.py; pyproject.toml pins the redis-py versions tested)"
    )


def test_a_moved_name_is_reported_by_its_symbol() -> None:
    """The check can fail, and says which symbol: a class attribute, an instance
    attribute, a module attribute and a module that are not there."""
    made_up = [
        private.Private("redis._parsers.hiredis:_HiredisParser", "read_more_please", "-"),
        private.Private("redis.connection:AbstractConnection", "_socket_v9", "-", instance=True),
        private.Private("redis._parsers.hiredis", "NOT_ENOUGH_DATA_V9", "-"),
        private.Private("redis._parsers.hiredis_v9", "NOT_ENOUGH_DATA", "-"),
        private.Private("redis.connection:NoSuchConnection", "_connect", "-"),
    ]
    assert private.missing([*private.PRIVATE, *made_up]) == [
        "redis._parsers.hiredis._HiredisParser.read_more_please",
        "redis.connection.AbstractConnection._socket_v9",
        "redis._parsers.hiredis.NOT_ENOUGH_DATA_V9",
        "redis._parsers.hiredis_v9.NOT_ENOUGH_DATA",
        "redis.connection.NoSuchConnection._connect",
    ]


@pytest.fixture
def pair() -> Iterator[tuple[redis.Connection, socket.socket]]:
    """A redis-py connection connected over a socket pair, and the pair's other end
    (where a server would write its replies)."""
    conn = redis.Connection(health_check_interval=10)  # type: ignore[no-untyped-call,unused-ignore]
    mine, server = socket.socketpair()
    private.connect_over(conn, mine)
    yield conn, server
    mine.close()
    server.close()


def test_the_lean_read_over_the_seam(pair: tuple[redis.Connection, socket.socket]) -> None:
    """What kvstate.store.wire does: gets() until the reply is whole, reading more between."""
    conn, server = pair
    found = private.hiredis_reader(conn)
    assert found is not None, "the hiredis parser is not the connection's"
    reader, read_more = found
    assert private.NOT_ENOUGH_DATA is not None
    assert reader.gets() is private.NOT_ENOUGH_DATA
    server.sendall(b"*2\r\n$2\r\nok")
    read_more()
    assert reader.gets() is private.NOT_ENOUGH_DATA  # half a reply
    server.sendall(b"\r\n:7\r\n+PONG\r\n")
    read_more()
    assert reader.gets() == [b"ok", 7]
    assert reader.gets() == b"PONG"
    assert reader.gets() is private.NOT_ENOUGH_DATA


def test_connection_facts_over_the_seam(pair: tuple[redis.Connection, socket.socket]) -> None:
    conn, _ = pair
    assert private.socket_of(conn) is not None
    assert "localhost:6379" in private.host_error(conn)
    assert isinstance(private.retry_of(conn), Retry)
    private.read_succeeded(conn)
    later = conn.next_health_check
    assert later > 0
    private.read_succeeded(conn)
    assert conn.next_health_check >= later


def test_connects_go_through_the_deadline() -> None:
    """A deadline-bound connection opens its socket through SocketOpener.open_socket:
    with the call's time already spent it raises DeadlineExceeded without connecting
    (not redis-py's connection refused from the closed port)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = BoundedPool(connection_class=redis.Connection, host="127.0.0.1", port=port)
    conn = pool.make_connection()
    assert isinstance(conn, DeadlineBoundConnection)
    with pytest.raises(DeadlineExceeded), deadline(-1.0):
        conn.connect()
    with pytest.raises(redis.ConnectionError, match="refused"):
        conn.connect()
    pool.disconnect()
