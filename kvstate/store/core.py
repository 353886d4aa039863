"""The Store: room state of one namespace in one Redis, and ``connect()`` to open one.

``Store`` is its parts put together: the call builders (``calls``), their execution
(``executor``), error translation (``translate``) and the server-level reads
(``admin``); here are what runs several of them (clear, abort, fail-bound fan-out,
SCAN) and the store's life (connect, dedicated, close).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvstate import schema
from kvstate.defaults import ROOM_TTL
from kvstate.errors import (
    InvalidOptionError,
    InvalidURLError,
    KVStateError,
    StateConnectionError,
    StateOutOfMemoryError,
)
from kvstate.keys import Keys, Side, check_room
from kvstate.store import embedded, functions, scripts
from kvstate.store.admin import Admin
from kvstate.store.calls import Call, Calls, check_reason, member_fields
from kvstate.store.connection import (
    ENV_NAMESPACE,
    ENV_URL,
    Client,
    Options,
    answers_plain_text,
    effective_options,
    make_client,
    redact,
)
from kvstate.store.deadline import deadline
from kvstate.store.translate import CONNECT_ERRORS, connect_error

EMBEDDED = "embedded"  # connect(EMBEDDED): the private redis-server, asked for by name


log = logging.getLogger(__name__)
PASSWORD_IGNORED = (
    "Redis at {url} has no password for its default user, so the password given was "
    "never checked (anyone who reaches the server needs none): set one there "
    "(requirepass, or an ACL user), or give none"
)


class Store(Calls, Admin):
    """Room state of one namespace in one Redis (standalone or Cluster)."""

    def __init__(
        self,
        client: Client,
        url: str,
        namespace: str = "default",
        room_ttl: float = ROOM_TTL,
        options: Options | None = None,
    ) -> None:
        _check_room_ttl(room_ttl)
        self.client = client
        self.url = redact(url)
        self.keys = Keys(namespace)
        self.namespace = self.keys.namespace
        self.room_ttl = float(room_ttl)
        self.cluster = not isinstance(client, redis.Redis)
        self.options = options or Options()
        self._pool = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._fcall = {}
        self.closed = False
        # the password given is one the server never asks for (set by connect())
        self.password_ignored = False

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "standalone"
        return f"<kvstate.Store {self.url} namespace={self.namespace!r} {kind}>"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections; every later call on this store (and on what was made
        on it) raises ClosedError. Idempotent."""
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.client.close()

    def dedicated(self) -> Store:
        """The same Redis, options and namespace over a client with its own connection
        pool: for a heartbeat that the workload's pool must not starve."""
        if self.closed:
            raise self.closed_error()
        client: Client
        if self.cluster:
            cluster: Any = self.client  # redis-py's Cluster API is untyped
            nodes = [ClusterNode(n.host, n.port) for n in cluster.get_primaries()]  # type: ignore[no-untyped-call]
            with self.errors():  # a Cluster client asks a node for the slot map when made
                client = RedisCluster(
                    startup_nodes=nodes, **cluster.nodes_manager.connection_kwargs
                )
        else:
            assert isinstance(self.client, redis.Redis)
            pool = self.client.connection_pool
            client = redis.Redis.from_pool(
                type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs)
            )
        store = Store(client, self.url, self.namespace, self.room_ttl, self.options)  # url redacted
        store._fcall, store.eval_only = self._fcall, self.eval_only  # the same servers
        return store

    def ping(self) -> None:
        with self.bounded():
            self.client.ping()

    def load_scripts(self) -> None:
        """Load the scripts on every primary up front, so steady-state calls never pay a
        round trip for it (they still recover after a restart, flush or failover): the
        function library where the node takes it (Redis >= 7.0, FUNCTION LOAD allowed),
        and that decides the node's way (FCALL); else SCRIPT LOAD of each (EVALSHA)."""
        with self.bounded():
            for _, node in self.nodes():
                fcall = not self.eval_only and functions.load(node)
                self._fcall[functions.node_key(node)] = fcall
                if not fcall:
                    scripts.load([node])

    def clear(
        self,
        room: int,
        side: Side,
        engine: str,
        senders: Iterable[str] = (),
        peer_addr: str | None = None,
        receivers: Iterable[str] = (),
    ) -> None:
        """Delete everything one participant created (``clear_calls``): one MULTI/EXEC on
        a standalone server; on a Cluster one round trip per node, a MULTI/EXEC per slot
        (the room's, the tracker's)."""
        calls = self.clear_calls(room, side, engine, senders, peer_addr, receivers)
        self.clear_many([calls], False)

    def clear_many(
        self, participants: Sequence[Sequence[Call]], partial: bool = True
    ) -> list[KVStateError | None]:
        """Clear many participants (each given by ``clear_calls``) in one round trip
        per node. With ``partial``, a participant whose node could not be reached
        (Cluster) gets its StateConnectionError in the answer (clear it again later: a
        clear can be repeated), one whose room holds a corrupt key its
        CorruptStateError, while the others are cleared; None means cleared."""
        calls = [c for group in participants for c in group]
        if not calls:
            return [None] * len(participants)
        with self.bounded():
            try:
                replies = self.execute(calls, transaction=True, partial=partial)
            except StateOutOfMemoryError:
                # At maxmemory Redis refuses every command queued in a MULTI, even DEL;
                # plain DEL/HDEL/ZREM are allowed (they free memory). Without the
                # transaction a cut connection can leave part of the participant behind:
                # those keys have TTLs, and a clear can be repeated. The trace's entry is
                # left out: it takes memory, and the clear must go through.
                kept = [i for i, c in enumerate(calls) if c.script != "trace"]
                done = self.execute([calls[i] for i in kept], partial=partial)
                replies = [None] * len(calls)
                for i, reply in zip(kept, done, strict=True):
                    replies[i] = reply
        out: list[KVStateError | None] = []
        at = 0
        for group in participants:
            failed = [r for r in replies[at : at + len(group)] if isinstance(r, KVStateError)]
            out.append(failed[0] if failed else None)
            at += len(group)
        return out

    # -- room-wide ---------------------------------------------------------------

    def members(self, room: int) -> list[str]:
        """The room hash's participant fields (``tx:<engine>`` / ``rx:<engine>``),
        sorted; its transfer infos and acks left out."""
        return member_fields(self.execute([self._command("HKEYS", self.keys.room_hash(room))])[0])

    def abort(self, room: int, reason: str) -> int:
        """Fail every participant of the room; returns how many moved to Failed."""
        room = check_room(room)
        moved = self.abort_many({room: reason}, partial=False)[room]
        assert isinstance(moved, int)  # not partial: an error was raised
        return moved

    def abort_many(
        self, reasons: Mapping[int, str], partial: bool = True
    ) -> dict[int, int | KVStateError]:
        """``abort()`` of many rooms, each with its reason, within one call's time: one
        round trip per node reads their participants, one fails them (and again for a
        room whose participants changed in between). Answers how many participants
        each room moved to Failed; with ``partial``, a room whose node did not answer
        or whose state is corrupt answers that error instead, the others aborted. Raises
        StateConnectionError when no node answered, or when the call's time ran out (a
        stalled node uses it up in the first trip: abort again)."""
        todo: dict[int, str] = {}
        for room, why in reasons.items():
            check_reason(why)
            todo[check_room(room)] = why
        out: dict[int, int | KVStateError] = {}
        k = self.keys
        with self.bounded():
            for _ in range(20):
                if not todo:
                    return out
                rooms = list(todo)
                listed = self.execute(
                    [self._command("HKEYS", k.room_hash(r)) for r in rooms], partial=partial
                )
                calls, called = [], []
                for room, raw in zip(rooms, listed, strict=True):
                    try:
                        if isinstance(raw, KVStateError):
                            raise raw
                        calls.append(self.abort_call(room, todo[room], member_fields(raw)))
                        called.append(room)
                    except KVStateError as exc:
                        if not partial:
                            raise
                        out[room] = exc
                        del todo[room]
                for room, n in zip(called, self.execute(calls, partial=partial), strict=True):
                    if isinstance(n, KVStateError) or n >= 0:  # -1: read them again
                        out[room] = n if isinstance(n, KVStateError) else int(n)
                        del todo[room]
        changing = KVStateError(f"room(s) {sorted(todo)} kept changing while aborting; try again")
        if not partial:
            raise changing
        return out | dict.fromkeys(todo, changing)

    def hold_many(self, rooms: Iterable[int], seconds: float) -> int:
        """A decode engine holds these rooms, whose requests wait in its queue, for
        ``seconds`` more (hold.lua, on the server clock): their senders' bootstrap
        timeout waits, so a long queue does not fail good requests, and a decode that
        stops holding (it died, or dropped the request) frees their pages one timeout
        later. Rooms that do not exist are skipped. One round trip per node; returns
        how many rooms were held."""
        ms = int(seconds * 1000)
        if not 0 < ms <= schema.MAX_TIMEOUT_MS:  # poll.lua refuses a longer one as corrupt
            raise InvalidOptionError(
                f"a hold must be > 0 s and at most {schema.MAX_TIMEOUT_MS // 1000} s, "
                f"got {seconds!r}"
            )
        calls = [self.hold(check_room(room), ms) for room in rooms]
        if not calls:
            return 0
        return sum(int(n) for n in self.execute(calls, partial=True) if isinstance(n, int))

    def fail_bound(
        self, bootstrap_addr: str, peer_engine: str, incarnation: str, reason: str
    ) -> int:
        """Fail the receivers bound to ``peer_engine`` (that incarnation, or any if '')
        among the rooms tracked for ``bootstrap_addr``; returns how many failed."""
        shards = self.keys.trackers(bootstrap_addr)  # one round trip per node
        replies = self.execute([self._command("ZRANGE", t, args=[0, -1]) for t in shards])
        members = [m for shard in replies for m in shard]
        # every member, not only those before their deadline: status changes keep a
        # receiver alive longer than the deadline its tracker entry got at creation
        # a corrupt room (or tracker member) fails alone: the others are still failed
        calls = []
        for m in members:
            key = self.keys.tracked_key(m.decode("utf-8", "replace"))
            if key is not None:
                calls.append(self.fail_receiver(key, peer_engine, incarnation, reason))
        replies = self.execute(calls, partial=True)
        return sum(int(n) for n in replies if isinstance(n, int))

    def scan(self, pattern: str, count: int = 1000) -> Iterator[str]:
        """Keys matching ``pattern`` on every primary (SCAN, never KEYS)."""
        with self.errors():
            for _, node in self.nodes():
                cursor = 0
                while True:
                    # bounded per step: a deadline must not span the yields below
                    with deadline(self.options.call_timeout):
                        cursor, keys = self._scan_step(node, cursor, pattern, count)
                    for key in keys:
                        yield key.decode()
                    if cursor == 0:
                        break

    def _scan_step(
        self, node: redis.Redis, cursor: int, pattern: str, count: int
    ) -> tuple[int, list[bytes]]:
        """One SCAN call, retried from the same cursor (cursors live in the client, not
        the server): a Cluster's node clients have no redis-py retries of their own."""
        for attempt in range(3):
            try:
                return node.scan(cursor, match=pattern, count=count)  # type: ignore[return-value]
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == 2 or not self.cluster:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def server_time_ms(self) -> int:
        client: Any = self.client
        with self.bounded():
            if self.cluster:
                secs, micros = client.time(target_nodes="random")
            else:
                secs, micros = client.time()
        return int(secs) * 1000 + int(micros) // 1000


class _HasStore(Protocol):
    store: Store


_S = TypeVar("_S", bound=_HasStore)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_call(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """Decorate a public method (of an object with a ``store``) that may make several
    round trips: they share one ``Options.call_timeout`` (the method's own deadline),
    so a failure recorded after a failed round trip cannot add a second wait."""

    def bounded(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.store.bounded():
            return method(self, *args, **kwargs)

    functools.update_wrapper(bounded, method)
    return bounded


def _check_room_ttl(room_ttl: object) -> None:
    if isinstance(room_ttl, bool) or not isinstance(room_ttl, (int, float)) or not room_ttl > 0:
        raise InvalidOptionError(f"room_ttl must be a number of seconds > 0, got {room_ttl!r}")


def connect(
    url: str | None = None,
    namespace: str | None = None,
    room_ttl: float = ROOM_TTL,
    *,
    cluster: bool | None = None,
    options: Options | None = None,
    preload_scripts: bool = True,
) -> Store:
    """Open the state store at ``url``, else ``$KVSTATE_REDIS_URL``; with neither,
    raise InvalidURLError naming them. ``url="embedded"`` (EMBEDDED) starts this
    process's private redis-server instead, by choice (docs/design.md, Zero setup).
    ``preload_scripts=False`` skips FUNCTION LOAD and SCRIPT LOAD, for readers (a
    read-only ACL user): a script still runs on first use (FUNCTION LOAD and FCALL
    after "Function not found", or EVAL)."""
    if url is None:
        url = os.environ.get(ENV_URL) or None
        if url is None:
            raise InvalidURLError(
                f"no Redis URL: pass kvstate.connect(url) or set ${ENV_URL} (e.g. "
                "redis://HOST:6379/0) on every engine process; for a private redis-server "
                f"that only this process tree can see, ask for it: connect({EMBEDDED!r})"
            )
    if url == EMBEDDED:
        url = embedded.ensure_server()
    if namespace is None:
        namespace = os.environ.get(ENV_NAMESPACE) or "default"
    keys = Keys(namespace)  # validate before connecting
    _check_room_ttl(room_ttl)
    opts = effective_options(url, options)  # also validates the URL and its parameters
    # One deadline for the whole of connect(): the Cluster client asks for the slots
    # when it is made, then PING, then FUNCTION LOAD (or SCRIPT LOAD) on every primary.
    with deadline(opts.call_timeout):
        probe_s = min(1.0, opts.connect_timeout, opts.call_timeout / 4)
        if url.startswith("rediss") and answers_plain_text(url, probe_s):
            raise StateConnectionError(
                f"Redis at {redact(url)} does not speak TLS on that port (it answered a "
                "plain-text PING): use redis://, or the port the server's tls-port names"
            )
        try:
            client = make_client(url, cluster, opts)
        except (ValueError, TypeError) as exc:  # redis-py refusing what it read of the URL
            if isinstance(exc, KVStateError):
                raise
            raise InvalidURLError(f"Redis URL {redact(url)} was refused: {exc}") from None
        except CONNECT_ERRORS as exc:
            raise connect_error(url, exc, opts.call_timeout) from None
        store = Store(client, url, keys.namespace, room_ttl, opts)
        try:
            store.ping()
            store.password_ignored = store.password_unused()
            if preload_scripts:
                store.load_scripts()
        except BaseException:
            store.close()
            raise
    if store.password_ignored:
        log.warning("%s", PASSWORD_IGNORED.format(url=store.url))
    return store
