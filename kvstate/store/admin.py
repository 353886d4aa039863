"""The server-level reads and settings ops and the CLI need, in kvstate's types.

A primary is named by a string (``primaries()``: the redacted URL of a standalone
server, ``host:port`` of a Cluster node), never handed out as a client; every error is
a KVStateError (``PermissionDeniedError`` where the ACL refuses the command, which
`kvstate doctor` and the audit report as a check that degrades, not a failure), and a
subscription is a ``Subscription``, not redis-py's PubSub.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis

from kvstate.errors import InvalidArgumentError, KVStateError, StateConnectionError
from kvstate.keys import Keys
from kvstate.store import functions
from kvstate.store.executor import Executor
from kvstate.store.notices import ChangeFeed
from kvstate.store.translate import Translating


class Subscription:
    """One node's subscription to a channel; reads what has arrived without waiting.
    A subscription that broke raises StateConnectionError."""

    def __init__(self, store: Translating, node: str, pubsub: redis.client.PubSub) -> None:
        self._store = store
        self._node = node
        self._sub = pubsub

    def next(self) -> str | None:
        """The data of the next message that has arrived, as text; None when none has."""
        try:
            while True:
                msg = self._sub.get_message(timeout=0.0)
                if msg is None:
                    return None
                if msg.get("type") == "message":
                    data = msg["data"]
                    return data.decode() if isinstance(data, bytes) else str(data)
        except (redis.RedisError, OSError) as exc:
            better = self._store.translate_error(exc)
            if isinstance(better, KVStateError):
                raise better from None
            raise StateConnectionError(f"subscription on {self._node} lost ({exc})") from None

    def close(self) -> None:
        """Unsubscribe and drop the connection; a broken one is closed quietly."""
        with contextlib.suppress(redis.RedisError, OSError):
            self._sub.close()


class Admin(Executor):
    """Server-level reads and settings of ``Store``, one primary at a time."""

    keys: Keys

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
        with self.errors():
            info: dict[str, Any] = self._primary(node).info(section)
        return info

    def eviction_policy(self, node: str | None = None) -> str:
        """``maxmemory-policy`` of one primary, from INFO memory (a reader's command:
        CONFIG GET would read every setting, ``requirepass`` included)."""
        return str(self.server_info(node, "memory").get("maxmemory_policy", ""))

    def probe_tag(self, node: str) -> int:
        """The hash tag of this namespace's expiry probe keys (``Keys.probe``) that
        ``node`` serves: on a Cluster, one of a slot of that primary."""
        if not self.cluster:
            return 0
        cluster: Any = self.client
        with self.errors():
            for tag in range(100_000):
                slot = cluster.keyslot(self.keys.probe(tag))
                if cluster.nodes_manager.get_node_from_slot(slot).name == node:
                    return tag
        raise InvalidArgumentError(f"{node} serves no slot: no probe key for it")

    def plant_probe(self, key: str, node: str) -> None:
        """SET the probe key with a 1 ms TTL on ``node`` (an operator's write)."""
        with self.errors():
            self._primary(node).set(key, "1", px=1)

    def touch_probe(self, key: str, node: str) -> bool:
        """EXISTS of the probe key on ``node``: a key past its TTL is deleted by the
        read, and its expiry event sent, now. True while it is there."""
        with self.errors():
            return bool(self._primary(node).exists(key))

    def config_get(self, name: str, node: str | None = None) -> str:
        """CONFIG GET of one setting on one primary, as text ('' when unset). An
        admin's: it is refused to every user of docs/security.md (a CONFIG GET user may read
        ``requirepass``); ``kvstate monitor`` tries it only to turn on expiry events."""
        with self.errors():
            raw: dict[Any, Any] = self._primary(node).config_get(name)
        for k, v in raw.items():
            if (k.decode() if isinstance(k, bytes) else k) == name:
                return v.decode() if isinstance(v, bytes) else str(v)
        return ""

    def config_set(self, name: str, value: str, node: str | None = None) -> None:
        """CONFIG SET of one setting on one primary."""
        with self.errors():
            self._primary(node).config_set(name, value)

    def expiry_events(self, node: str | None = None) -> Subscription:
        """A subscription to one primary's key expiry events (``notify-keyspace-events``
        must hold Ex; see ``config_set``). Node-local on a Cluster."""
        with self.errors():
            client = self._primary(node)
            db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
            sub: redis.client.PubSub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            sub.subscribe(f"__keyevent@{db}__:expired")
        return Subscription(self, node or self.primaries()[0], sub)

    def changes(self, engine: str) -> ChangeFeed:
        """An engine's change notices (``Keys.changed``), on a connection of its own to
        one primary: on a Cluster every node delivers what any node publishes."""
        with self.errors():
            pool = self._primary(None).connection_pool
        # a pool of its own: a subscribed connection taken from the store's pool would
        # make the store's next call open (and handshake) another one
        own = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
        client = redis.Redis(connection_pool=own)
        return ChangeFeed(client, self.keys, engine)

    def whoami(self) -> str | None:
        """The ACL user this store runs as; None when the server does not say (ACL
        WHOAMI refused, or a server without ACLs)."""
        try:
            raw = self._primary(None).acl_whoami()
        except redis.RedisError:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def libraries(self, node: str | None = None) -> list[functions.Library] | None:
        """kvstate's FUNCTION libraries on one primary (FUNCTION LIST LIBRARYNAME
        kvstate_* WITHCODE); None where the server has no FUNCTION (Redis 6.2, or the
        command renamed away). PermissionDeniedError where the ACL refuses it."""
        args = ("FUNCTION", "LIST", "LIBRARYNAME", functions.PREFIX + "*", "WITHCODE")
        try:
            with self.errors():
                reply = self._primary(node).execute_command(*args)  # type: ignore[no-untyped-call]
        except KVStateError as exc:
            if _unknown_command(exc):
                return None
            raise
        return [lib for lib in functions.libraries(reply) if lib.name.startswith(functions.PREFIX)]

    def load_library(self, node: str | None = None, replace: bool = False) -> str:
        """FUNCTION LOAD this kvstate's library on one primary (an admin's step: the
        docs/security.md's engine and operator users may not). 'loaded', 'present' (there with
        this exact code already), or, with ``replace``, 'replaced' (a library of that
        name held other code: someone else loaded it); without ``replace`` such a
        library raises InvalidArgumentError saying so."""
        present = [lib for lib in self.libraries(node) or [] if lib.name == functions.NAME]
        if present and present[0].current:
            return "present"
        if present and not replace:
            raise InvalidArgumentError(
                f"{node or self.primaries()[0]} holds a library named {functions.NAME} whose "
                "code is not this kvstate's (loaded by someone else, or changed): engines "
                "will not run it (they take the EVAL path). Look at it (redis-cli FUNCTION "
                f"LIST LIBRARYNAME {functions.NAME} WITHCODE), then replace it with "
                "--replace"
            )
        head = ("FUNCTION", "LOAD", "REPLACE") if present else ("FUNCTION", "LOAD")
        with self.errors():
            self._primary(node).execute_command(*head, functions.LIBRARY)  # type: ignore[no-untyped-call]
        return "replaced" if present else "loaded"

    def delete_library(self, name: str, node: str | None = None) -> bool:
        """FUNCTION DELETE one of kvstate's libraries on one primary; False when it was
        not there (an admin's step)."""
        if not name.startswith(functions.PREFIX):
            raise InvalidArgumentError(f"{name!r} is not a kvstate library ({functions.PREFIX}...)")
        try:
            with self.errors():
                self._primary(node).execute_command("FUNCTION", "DELETE", name)  # type: ignore[no-untyped-call]
        except KVStateError as exc:
            if "library not found" in str(exc).lower():
                return False
            raise
        return True

    def password_unused(self) -> bool:
        """Whether the password this store was given is one the server never asks for:
        a default user without a password lets every connection in, and redis-py drops
        AUTH's "called without any password configured" answer (redis-cli prints it).
        Asked once (connect()), with AUTH's one-argument form, on one primary; an ACL
        user's password (a user name given) is always checked by the server."""
        client = self._primary(None)
        kwargs = client.connection_pool.connection_kwargs
        password, user = kwargs.get("password"), kwargs.get("username")
        if not password or user not in (None, "", "default"):
            return False
        try:
            client.execute_command("AUTH", password)  # type: ignore[no-untyped-call,unused-ignore]
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            return "without any password configured" in str(exc)
        except redis.RedisError:  # refused or unreachable: connect()'s PING says so
            return False
        return False

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


def _unknown_command(exc: BaseException) -> bool:
    """A reply that the server knows no such command (Redis 6.2's FUNCTION)."""
    text = str(exc).lower()
    return "unknown command" in text or "unknown subcommand" in text
