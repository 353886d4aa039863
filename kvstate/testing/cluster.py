"""A local Redis Cluster for tests and tools: start, wait until ready, fail over, stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvstate.errors import RedisServerError
from kvstate.store import (
    PLAIN_ERRORS,
    PlainClient,
    PlainClusterClient,
    find_redis_server,
    log_tail,
    no_retry,
    plain_cluster_client,
)
from kvstate.testing.process import (
    RedisProcess,
    binary_version,
    find_redis_cli,
    free_port_pair,
)

__all__ = ["CLUSTER_SLOTS", "RedisCluster"]

CLUSTER_SLOTS = 16384


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cluster_info(client: PlainClient) -> dict[str, str]:
    raw = client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    if isinstance(raw, dict):  # redis-py parses it already
        return {_decode(k): _decode(v) for k, v in raw.items()}
    info: dict[str, str] = {}
    for line in _decode(raw).splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            info[key] = value
    return info


@dataclass(frozen=True)
class _NodeView:
    node_id: str
    flags: frozenset[str]
    master_id: str
    connected: bool


def _cluster_nodes(client: PlainClient) -> dict[int, _NodeView]:
    """CLUSTER NODES as seen by one node, by port (redis-py parses it, or raw text)."""
    raw = client.execute_command("CLUSTER NODES")  # type: ignore[no-untyped-call]
    result: dict[int, _NodeView] = {}
    if isinstance(raw, dict):
        for addr, d in raw.items():
            port = int(_decode(addr).split("@")[0].rsplit(":", 1)[1])
            result[port] = _NodeView(
                _decode(d["node_id"]),
                frozenset(_decode(d["flags"]).split(",")),
                _decode(d["master_id"]),
                bool(d["connected"]),
            )
        return result
    for line in _decode(raw).splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        port = int(fields[1].split("@")[0].split(",")[0].rsplit(":", 1)[1])
        result[port] = _NodeView(
            fields[0], frozenset(fields[2].split(",")), fields[3], fields[7] == "connected"
        )
    return result


def _role(client: PlainClient) -> str:
    role = client.execute_command("ROLE")[0]  # type: ignore[no-untyped-call]
    return role.decode() if isinstance(role, bytes) else str(role)


class RedisCluster:
    """A local Redis Cluster: ``primaries`` primaries with ``replicas`` replicas each.

    Every node is a :class:`RedisProcess` on a free TCP port (and its bus port
    ``port + 10000``), in its own subdirectory of ``directory``.
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        directory: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        cli: str | None = None,
        die_with_parent: bool = True,
        startup_timeout: float = 60.0,
    ) -> None:
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.primaries_count = primaries
        self.replicas_count = replicas
        self.host = host
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = list(extra_args)
        self.binary = binary or find_redis_server()
        self.cli = cli or find_redis_cli()
        self.die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self._owns_dir = directory is None
        self._dir: Path | None = None if directory is None else Path(directory)
        self.nodes: list[RedisProcess] = []

    @property
    def directory(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvstate-cluster-"))
        return self._dir

    @property
    def version(self) -> tuple[int, int, int]:
        return binary_version(self.binary)

    @property
    def url(self) -> str:
        if not self.nodes:
            raise RedisServerError("cluster not started")
        return f"redis+cluster://{self.host}:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def __repr__(self) -> str:
        return (
            f"<RedisCluster primaries={self.primaries_count} replicas={self.replicas_count}"
            f" ports={self.ports}>"
        )

    def client(self, **kwargs: Any) -> PlainClusterClient:
        if not self.nodes:
            raise RedisServerError("cluster not started")
        return plain_cluster_client(self.host, self.nodes[0].port, **kwargs)

    def node_client(self, node: RedisProcess) -> PlainClient:
        """A client of one node, without client-side retries: callers poll in their own
        loops with their own deadline."""
        return node.client(socket_timeout=5.0, socket_connect_timeout=2.0, retry=no_retry())

    # ---- lifecycle

    def start(self) -> Self:
        if self.nodes:
            return self
        total = self.primaries_count * (1 + self.replicas_count)
        try:
            for _ in range(total):
                self.nodes.append(self._start_node())
            self._create()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self) -> RedisProcess:
        last: RedisServerError | None = None
        for _ in range(5):
            port = free_port_pair(10000, self.host)
            node_dir = self.directory / f"node-{port}"
            node = RedisProcess(
                node_dir,
                unix_socket=False,
                port=port,
                host=self.host,
                binary=self.binary,
                die_with_parent=self.die_with_parent,
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    # replicas sync at once (the 7.x default waits 5 s for more replicas)
                    "--repl-diskless-sync",
                    "yes",
                    "--repl-diskless-sync-delay",
                    "0",
                    *self.extra_args,
                ],
            )
            try:
                return node.start()
            except RedisServerError as exc:  # port taken in the meantime: try another
                last = exc
                node.stop()
                shutil.rmtree(node_dir, ignore_errors=True)
                if "Address already in use" not in str(exc):
                    raise
        assert last is not None
        raise last

    def _create(self) -> None:
        cmd = [
            self.cli,
            "--cluster",
            "create",
            *(f"{self.host}:{n.port}" for n in self.nodes),
            "--cluster-replicas",
            str(self.replicas_count),
            "--cluster-yes",
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=self.startup_timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RedisServerError(
                f"redis-cli --cluster create failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )

    def _problems(self) -> list[str]:
        """Why the cluster is not (yet) fully ready; empty when it is.

        Ready: every node says cluster_state:ok with all slots served and knows every
        node; every node's CLUSTER NODES view agrees with each node's own ROLE (which
        node replicates which, nothing flagged fail/handshake, every link connected);
        every replica's replication link is up.
        """
        problems: list[str] = []
        total = len(self.nodes)
        ids: dict[int, str] = {}
        truth: dict[int, tuple[str, int]] = {}  # port -> (role, primary port or 0)
        views: dict[int, dict[int, _NodeView]] = {}
        for node in self.nodes:
            try:
                with self.node_client(node) as c:
                    info = _cluster_info(c)
                    if info.get("cluster_state") != "ok":
                        problems.append(f"{node.port}: cluster_state={info.get('cluster_state')}")
                    if info.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                        problems.append(f"{node.port}: slots_ok={info.get('cluster_slots_ok')}")
                    if info.get("cluster_known_nodes") != str(total):
                        problems.append(f"{node.port}: known={info.get('cluster_known_nodes')}")
                    role = c.execute_command("ROLE")
                    if _decode(role[0]) == "slave":
                        truth[node.port] = ("slave", int(role[2]))
                        if _decode(role[3]) != "connected":
                            problems.append(f"{node.port}: replication {_decode(role[3])}")
                    else:
                        truth[node.port] = ("master", 0)
                    ids[node.port] = _decode(c.execute_command("CLUSTER MYID"))
                    views[node.port] = _cluster_nodes(c)
            except (*PLAIN_ERRORS, ValueError, IndexError) as exc:
                problems.append(f"{node.port}: {exc}")
        if problems:
            return problems
        for port, view in views.items():
            for other, (role, primary_port) in truth.items():
                seen = view.get(other)
                if seen is None:
                    problems.append(f"{port} does not know {other}")
                    continue
                bad = seen.flags & {"fail", "fail?", "handshake", "noaddr"}
                if bad:
                    problems.append(f"{port} sees {other} as {','.join(sorted(bad))}")
                if role not in seen.flags:
                    problems.append(f"{port} does not see {other} as {role} yet")
                elif role == "slave" and seen.master_id != ids.get(primary_port):
                    problems.append(f"{port} does not see {other} replicating {primary_port}")
                if "myself" not in seen.flags and not seen.connected:
                    problems.append(f"{port} has no link to {other}")
        return problems

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every node reports cluster_state:ok with all 16384 slots covered,
        knows every node, and every replica's link to its primary is up."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        problems = self._problems()
        while problems:
            if time.monotonic() > deadline:
                raise RedisServerError("cluster not ready: " + "; ".join(problems))
            time.sleep(0.05)
            problems = self._problems()

    def stop(self) -> None:
        for node in self.nodes:  # signal every node first, so they shut down in parallel
            if node.alive and node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self._owns_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- topology

    def node_id(self, node: RedisProcess) -> str:
        with self.node_client(node) as c:
            raw = c.execute_command("CLUSTER MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def role(self, node: RedisProcess) -> str:
        """``"master"`` or ``"slave"`` (the words ROLE uses)."""
        with self.node_client(node) as c:
            return _role(c)

    def primaries(self) -> list[RedisProcess]:
        """Nodes that are primaries right now (asked live: failovers change this)."""
        return [n for n in self.nodes if n.alive and self.role(n) == "master"]

    def replicas_of(self, primary: RedisProcess) -> list[RedisProcess]:
        """Live nodes replicating ``primary`` right now."""
        result = []
        for node in self.nodes:
            if node is primary or not node.alive:
                continue
            with self.node_client(node) as c:
                role = c.execute_command("ROLE")
            if _decode(role[0]) == "slave" and int(role[2]) == primary.port:
                result.append(node)
        return result

    def node_for_key(self, key: str | bytes) -> RedisProcess:
        """The primary serving ``key``'s slot."""
        first = self.primaries()[0]
        with self.node_client(first) as c:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RedisServerError(f"no node serves slot {slot}")

    def failover(self, node: RedisProcess, timeout: float = 30.0) -> RedisProcess:
        """Promote a replica of primary ``node`` with CLUSTER FAILOVER; wait until the
        roles have swapped and the cluster is ready again. Returns the new primary."""
        replicas = self.replicas_of(node)
        if not replicas:
            raise RedisServerError(f"node {node.port} has no replica to fail over to")
        replica = replicas[0]
        deadline = time.monotonic() + timeout
        self._wait_primary_knows(node, replica, deadline)
        # The primary must answer the replica's request (MFSTART) on the cluster bus; if it
        # does not (just after an earlier failover, or on a loaded machine) the replica
        # drops the request after 5 s without an error. A healthy handshake takes well
        # under a second, so ask again every 2 s until the deadline.
        attempt_s = 2.0
        attempts = 0
        while True:
            attempts += 1
            with self.node_client(replica) as c:
                c.execute_command("CLUSTER FAILOVER")
            attempt_end = min(deadline, time.monotonic() + attempt_s)
            while time.monotonic() < attempt_end:
                with contextlib.suppress(*PLAIN_ERRORS):
                    if self.role(replica) == "master" and self.role(node) == "slave":
                        self.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
                        return replica
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                raise RedisServerError(
                    f"failover of {node.port} to {replica.port} did not finish in {timeout} s "
                    f"({attempts} CLUSTER FAILOVER sent)\n--- replica log ---\n"
                    f"{log_tail(replica.logfile)}"
                )

    def _wait_primary_knows(
        self, primary: RedisProcess, replica: RedisProcess, deadline: float
    ) -> None:
        """Wait until ``primary`` sees ``replica`` as its replica on the cluster bus."""
        primary_id = self.node_id(primary)
        while time.monotonic() < deadline:
            with contextlib.suppress(*PLAIN_ERRORS), self.node_client(primary) as c:
                seen = _cluster_nodes(c).get(replica.port)
                if seen is not None and "slave" in seen.flags and seen.master_id == primary_id:
                    return
            time.sleep(0.05)

    def flushall(self) -> None:
        """FLUSHALL on every primary (replicas follow)."""
        for node in self.primaries():
            with self.node_client(node) as c:
                c.flushall()
