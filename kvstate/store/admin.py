"""The server-level reads and settings ops and the CLI need, in kvstate's types.

A primary is named by a string (``primaries()``: the redacted URL of a standalone
server, ``host:port`` of a Cluster node), never handed out as a client; every error is
a KVStateError (``PermissionDeniedError`` where the ACL refuses the command, which
`kvstate doctor` and the audit report as a check that degrades, not a failure), and a
subscription is a ``Subscription``, not redis-py's PubSub.
"""

from __future__ import annotations

from typing import Any

import redis

from kvstate.errors import InvalidArgumentError
from kvstate.store.executor import Executor


class Admin(Executor):
    """Server-level reads and settings of ``Store``, one primary at a time."""

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

    def whoami(self) -> str | None:
        """The ACL user this store runs as; None when the server does not say (ACL
        WHOAMI refused, or a server without ACLs)."""
        try:
            raw = self._primary(None).acl_whoami()
        except redis.RedisError:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

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
