"""One round trip on a redis-py connection, without redis-py's command layer.

The Store's hot path: every command of a batch is packed by hiredis into one buffer,
written with one ``send_packed_command`` and read back in one loop over the
connection's own hiredis reader. The connection comes from the client's pool, so
connecting, AUTH/ACL, TLS, unix sockets, health checks, reconnects and kvstate's
deadline-bounded sockets (kvstate.store.connection) stay redis-py's; what this skips is the
pipeline object, per-command bookkeeping and observability hooks, which cost more
than Redis itself per call (issue 12). Replies come back raw: error replies as the
exception objects redis-py's parser makes of them (NoScriptError, MovedError, ...),
never raised here; only connection trouble raises. What it needs of redis-py beyond
its public API (the reader, the sentinel, ...) comes through kvstate.store.redispy_private.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstate.store import redispy_private as private
from kvstate.store.deadline import DeadlineBoundConnection

_MORE = private.NOT_ENOUGH_DATA  # what the reader returns while a reply is incomplete

Command = Sequence[Any]


def pack(command: Command) -> bytes:
    """One command in RESP, exactly as redis-py's hiredis packer would write it."""
    try:
        return bytes(hiredis.pack_command(tuple(command)))
    except TypeError as exc:
        fixed = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in command)
        if fixed != tuple(command):
            return pack(fixed)
        raise DataError(str(exc)) from None


def roundtrip(client: redis.Redis, payload: bytes, count: int) -> list[Any]:
    """Send ``payload`` (``count`` packed commands) on a pooled connection of
    ``client`` and return the ``count`` raw replies. Connection errors are retried by
    the client's own retry policy (within the call's deadline), like redis-py's
    pipeline: every batch kvstate sends is safe to send twice."""
    pool = client.connection_pool
    conn: Any = pool.get_connection()
    sent: list[bool] = []  # a write reached the socket: Redis may have run it
    try:
        replies: list[Any] = private.retry_of(conn).call_with_retry(
            lambda: _exchange(conn, payload, count, sent), lambda _err: conn.disconnect()
        )
        return replies
    except (RedisConnectionError, RedisTimeoutError) as exc:
        if sent:
            setattr(exc, MAY_HAVE_RUN, True)  # noqa: B010 - an attribute of our own
        raise
    finally:
        pool.release(conn)


# set on a connection error raised after the batch was written (its reply is what was
# lost): kvstate.store.translate carries it into StateConnectionError.may_have_run
MAY_HAVE_RUN = "kvstate_may_have_run"


def _exchange(conn: Any, payload: bytes, count: int, sent: list[bool]) -> list[Any]:
    conn.send_packed_command((payload,))  # connects, health-checks, bounds the socket
    sent.append(True)
    found = private.hiredis_reader(conn)
    if found is None or _MORE is None:
        return _exchange_slow(conn, count)
    reader, read_more = found
    replies: list[Any] = []
    # kvstate's deadline on each wait (a client made by kvstate.store.connection)
    bound = conn.bound_socket if isinstance(conn, DeadlineBoundConnection) else None
    try:
        while len(replies) < count:
            reply = reader.gets()
            if reply is _MORE:
                if bound is not None:
                    bound()
                read_more()
                continue
            if isinstance(reply, RedisConnectionError):  # e.g. max clients reached
                raise reply
            replies.append(reply)
    except TimeoutError:  # socket.timeout
        conn.disconnect()
        raise RedisTimeoutError(f"Timeout reading from {private.host_error(conn)}") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(
            f"Error while reading from {private.host_error(conn)}: {exc.args}"
        ) from None
    except BaseException:
        conn.disconnect()  # a reply half read: the socket cannot be reused
        raise
    private.read_succeeded(conn)
    return replies


def _exchange_slow(conn: Any, count: int) -> list[Any]:
    """The same through redis-py's read_response, for a parser without hiredis."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(conn.read_response(disable_decoding=False))
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies


__all__ = ["pack", "roundtrip"]
