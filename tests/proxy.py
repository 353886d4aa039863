"""A small TCP proxy for fault tests: put it between a client and a real server, then
switch what the network does while the client runs.

    with Proxy(("127.0.0.1", redis_port)) as proxy:
        store = kvstate.connect(proxy.url(), ...)
        proxy.stall()        # connections open, nothing flows (a frozen server)
        proxy.blackhole()    # nothing flows and new connections get no SYN-ACK
        proxy.delay(0.2)     # every chunk forwarded 0.2 s late
        proxy.drop()         # every connection reset, new ones refused (server down)
        proxy.mute()         # requests reach the server, its replies are lost
        proxy.drop_after(2)  # two more requests go through (replies too), then drop()
        proxy.passthrough()  # back to normal; held bytes flow again

Threads, no asyncio: two pump threads per connection and one accept thread. A stall or
black hole holds bytes back without reading them, so a switch back to ``passthrough``
delivers what was sent meanwhile (like SIGCONT after SIGSTOP).

``ProxiedCluster``: a private 3-primary Cluster with its third primary behind a Proxy
(for faults on one node); ``rooms_by_port`` groups rooms by the port of their primary.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import redis

from kvstate import KVManager, KVPoll
from kvstate.store import Store
from kvstate.testing import RedisCluster
from tests.helpers import PREFILL_ADDR, wait_for

Mode = Literal["pass", "delay", "stall", "blackhole", "drop", "mute"]
_TICK = 0.02


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``target``; ``mode`` is switched at any time."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._mode: Mode = "pass"
        self._delay = 0.0
        self._countdown: int | None = None  # requests to let through before drop()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._fillers: list[socket.socket] = []
        self._stop = threading.Event()
        self.port = 0
        self._listener: socket.socket | None = self._listen()
        self._threads: list[threading.Thread] = []

    def _listen(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        # a one-slot accept queue: filling it makes the kernel drop new SYNs (black hole)
        s.listen(0)
        self.port = s.getsockname()[1]
        return s

    # -- control -------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self._mode

    def url(self, scheme: str = "redis", query: str = "") -> str:
        return f"{scheme}://127.0.0.1:{self.port}" + (f"?{query}" if query else "")

    def passthrough(self) -> None:
        self._countdown = None
        self._set("pass")

    def delay(self, seconds: float) -> None:
        self._delay = seconds
        self._set("delay")

    def stall(self) -> None:
        """Connections stay open and new ones are accepted, but no byte moves."""
        self._set("stall")

    def blackhole(self) -> None:
        """No byte moves, and a new connection never completes its handshake."""
        self._set("blackhole")
        self._fill_accept_queue()

    def mute(self) -> None:
        """Requests still reach the server (and run there); every reply is lost."""
        self._set("mute")

    def drop(self) -> None:
        """Reset every connection and stop listening: new ones are refused (server down)."""
        self._set("drop")
        with self._lock:
            conns, self._conns = self._conns, []
            listener, self._listener = self._listener, None
        for s in conns:
            _reset(s)
        if listener is not None:
            listener.close()

    def drop_after(self, requests: int) -> None:
        """Forward ``requests`` more client writes (each a request or pipeline, on any
        connection) and their replies, then ``drop()`` before the next one reaches the
        server: a server lost between two round trips of one step."""
        with self._lock:
            self._countdown = requests

    def _set(self, mode: Mode) -> None:
        with self._lock:
            self._mode = mode
            fillers, self._fillers = (self._fillers, []) if mode != "blackhole" else ([], [])
            if mode != "drop" and self._listener is None:
                self._listener = self._listen()
        for s in fillers:
            s.close()

    def _fill_accept_queue(self) -> None:
        """Connect to ourselves until a connect no longer completes: the queue is full."""
        for _ in range(8):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", self.port))
            with self._lock:
                self._fillers.append(s)
            _, writable, _ = select.select([], [s], [], 0.3)
            if not writable:
                return  # this SYN was dropped: so will the next client's be
        raise RuntimeError("could not fill the proxy's accept queue")

    # -- life ---------------------------------------------------------------------
    def start(self) -> Self:
        self._spawn(self._accept_loop)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
            fillers, self._fillers = self._fillers, []
        for s in conns + fillers:
            s.close()
        for t in self._threads:
            t.join(2)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if self._mode in ("blackhole", "drop") or listener is None:
                time.sleep(_TICK)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], _TICK)
                if not ready or self._mode in ("blackhole", "drop"):
                    continue
                client, _ = listener.accept()
            except OSError:
                continue  # closed by drop() or close()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        """Copy src to dst while the mode lets bytes through; hold them otherwise (and
        lose the server's ``replies`` while muted)."""
        try:
            while not self._stop.is_set():
                if self._mode in ("stall", "blackhole"):
                    time.sleep(_TICK)
                    continue
                if self._mode == "drop":
                    return
                ready, _, _ = select.select([src], [], [], _TICK)
                if not ready or self._mode in ("stall", "blackhole", "drop"):
                    continue  # the mode may have changed while select waited
                data = src.recv(65536)
                if not data:
                    break
                if self._mode == "delay":
                    time.sleep(self._delay)
                if replies and self._mode == "mute":
                    continue
                if not replies and self._countdown is not None:
                    with self._lock:
                        self._countdown -= 1
                        last = self._countdown < 0
                        if last:
                            self._countdown = None
                    if last:  # this request is the one past the count: never sent
                        self.drop()
                        return
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: the socket was closed meanwhile
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dead host's kernel would answer."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


# --------------------------------------------------------------------------- Cluster


class ProxiedCluster:
    """A private 3-primary Cluster whose third primary is reached through a Proxy: the
    node announces the proxy's port, so clients (redis-py included) go through it."""

    def __init__(self, tmp_path: Path) -> None:
        self.cluster = RedisCluster(3, 0, tmp_path / "c").start()
        self.target = self.cluster.nodes[2]
        self.proxy = Proxy(("127.0.0.1", self.target.port)).start()
        with self.target.client() as c:
            c.config_set("cluster-announce-bus-port", self.target.port + 10000)
            c.config_set("cluster-announce-port", self.proxy.port)
        # every other node's view: a client that refreshes its slots (after the node
        # dropped) from one still naming the node's own port would go around the proxy
        # (the node's own view may keep its port: Redis 6.2)
        for node in self.cluster.nodes:
            if node is self.target:
                continue
            with node.client() as c:
                assert wait_for(lambda c=c: self.target.port not in _slot_ports(c), 20.0), (
                    f"the announced port did not spread to {node.port}"
                )

    @property
    def url(self) -> str:
        return self.cluster.url  # node 0: not behind the proxy

    def close(self) -> None:
        self.proxy.close()
        self.cluster.stop()


def _slot_ports(c: redis.Redis) -> set[int]:
    return {int(node[1]) for slot in c.execute_command("CLUSTER", "SLOTS") for node in slot[2:]}


def waiting_rooms(
    pc: ProxiedCluster, store: Store, p: KVManager, d: KVManager, count: int
) -> tuple[list[int], set[int]]:
    """Rooms 0..count-1, each a sender on ``p`` and a receiver on ``d`` that published
    its pages, all WaitingForInput; and which of them live on the proxied primary."""
    rooms = list(range(count))
    for r in rooms:
        p.sender(r)
        d.receiver(r, PREFILL_ADDR).init([1, 2])
    assert p.poll_many(rooms) == dict.fromkeys(rooms, KVPoll.WaitingForInput)
    return rooms, set(rooms_by_port(store, count)[pc.proxy.port])


def rooms_by_port(store: Store, count: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for room in range(count):
        key = store.keys.participant(room, "tx", "x")
        port = int(store.client.get_node_from_key(key).port)  # type: ignore[union-attr]
        out.setdefault(port, []).append(room)
    return out
