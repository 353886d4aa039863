"""One round trip on a redis-py connection, without redis-py's command layer.

The Store's hot path: every command of a batch is packed by hiredis into one buffer,
written with one ``send_packed_command`` and read back in one loop over the
connection's own hiredis reader. The connection comes from the client's pool, so
connecting, AUTH/ACL, TLS, unix sockets, health checks, reconnects and kvstate's
deadline-bounded sockets (kvstate.connection) stay redis-py's; what this skips is the
pipeline object, per-command bookkeeping and observability hooks, which cost more
than Redis itself per call (issue 12). Replies come back raw: error replies as the
exception objects redis-py's parser makes of them (NoScriptError, MovedError, ...),
never raised here; only connection trouble raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # the sentinel redis-py's hiredis reader returns while a reply is incomplete
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _MORE
except ImportError:  # pragma: no cover - another redis-py layout: the slow path below
    _MORE = None

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
    try:
        return conn.retry.call_with_retry(  # type: ignore[no-any-return]
            lambda: _exchange(conn, payload, count), lambda _err: conn.disconnect()
        )
    finally:
        pool.release(conn)


def _exchange(conn: Any, payload: bytes, count: int) -> list[Any]:
    conn.send_packed_command((payload,))  # connects, health-checks, bounds the socket
    parser = conn._parser
    reader = getattr(parser, "_reader", None)
    if reader is None or _MORE is None or not hasattr(parser, "read_from_socket"):
        return _exchange_slow(conn, count)
    replies: list[Any] = []
    bound = getattr(conn, "_bound_socket", None)  # kvstate's deadline on each wait
    try:
        while len(replies) < count:
            reply = reader.gets()
            if reply is _MORE:
                if bound is not None:
                    bound()
                parser.read_from_socket()
                continue
            if isinstance(reply, RedisConnectionError):  # e.g. max clients reached
                raise reply
            replies.append(reply)
    except TimeoutError:  # socket.timeout
        conn.disconnect()
        raise RedisTimeoutError(f"Timeout reading from {conn._host_error()}") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(
            f"Error while reading from {conn._host_error()}: {exc.args}"
        ) from None
    except BaseException:
        conn.disconnect()  # a reply half read: the socket cannot be reused
        raise
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
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
