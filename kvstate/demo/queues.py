"""How messages move between the router and its workers: spawn queues and one pipe per
worker on one machine; with ``--listen`` / ``--router``, queues served over TCP by a
multiprocessing manager. Both carry pickles, hence the shared secret."""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.managers import BaseManager
from typing import Any, Generic, Protocol, TypeVar

import click

from kvstate.demo.messages import ToRouter, ToWorker, WorkerConfig
from kvstate.errors import KVStateError

__all__ = [
    "ENV_AUTHKEY",
    "Channel",
    "Inbox",
    "Outbox",
    "PipeOut",
    "RemoteQueues",
    "attach",
    "authkey",
    "hostport",
]

T = TypeVar("T")

ENV_AUTHKEY = "KVSTATE_DEMO_AUTHKEY"
MIN_AUTHKEY_CHARS = 16
_PUBLIC_KEYS = frozenset({"kvstate-demo"})  # the old default, published in this repository


class Channel(Protocol, Generic[T]):
    """The part of a queue the demo uses: spawn Queue, queue.Queue, manager proxy, pipe."""

    def put(self, item: T) -> None: ...
    def get(self, block: bool = True, timeout: float | None = None) -> T: ...


Inbox = Channel[ToWorker]  # router -> one worker
Outbox = Channel[ToRouter]  # workers -> router


class PipeOut:
    """A worker's own one-way channel to the router. One pipe per worker, not a shared
    Queue: a worker SIGKILLed while holding a shared queue's lock would stall the rest."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, item: ToRouter) -> None:
        self.conn.send(item)

    def get(self, block: bool = True, timeout: float | None = None) -> ToRouter:
        raise NotImplementedError("the router reads this channel")


class _QueueManager(BaseManager):
    """Serves the router's queues over TCP so workers in other containers can attach."""


def authkey() -> bytes:
    """The secret that --listen and --router share. Their queues carry pickles, and
    unpickling runs code: whoever can connect with the key can run code in the router
    and every worker. So there is no default; the user sets one (spawned local workers
    use pipes, not the network, and need none)."""
    key = os.environ.get(ENV_AUTHKEY, "")
    if not key:
        raise KVStateError(
            f"--listen/--router need a shared secret: set {ENV_AUTHKEY} to one of at least "
            f"{MIN_AUTHKEY_CHARS} characters (e.g. `openssl rand -hex 16`) in the environment "
            "of the router and of every worker; the queues carry pickles, which run code"
        )
    if key in _PUBLIC_KEYS or len(key) < MIN_AUTHKEY_CHARS:
        why = "a published default" if key in _PUBLIC_KEYS else f"{len(key)} characters"
        raise KVStateError(
            f"{ENV_AUTHKEY} is too weak ({why}): use a secret of at least "
            f"{MIN_AUTHKEY_CHARS} characters, e.g. `openssl rand -hex 16`"
        )
    return key.encode()


def hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


class RemoteQueues:
    """The router side of ``--listen``: one inbox per engine name, one shared outbox."""

    def __init__(self, listen: str, cfg: WorkerConfig) -> None:
        self.outbox: queue.Queue[ToRouter] = queue.Queue()
        self.inboxes: dict[str, queue.Queue[ToWorker]] = {}
        self.lock = threading.Lock()
        mgr = _QueueManager(address=hostport(listen), authkey=authkey())
        mgr.register("inbox", callable=self.inbox)
        mgr.register("outbox", callable=lambda: self.outbox)
        mgr.register("config", callable=lambda: cfg)
        self.server = mgr.get_server()
        threading.Thread(
            target=self.server.serve_forever, name="kvstate-demo-queues", daemon=True
        ).start()

    def inbox(self, engine: str) -> queue.Queue[ToWorker]:
        """The inbox of ``engine``, whether or not it has attached yet."""
        with self.lock:
            return self.inboxes.setdefault(engine, queue.Queue())


def attach(router: str, engine: str) -> tuple[Inbox, Outbox, WorkerConfig]:
    """The worker side of ``--router``: our inbox, the outbox and the run's config."""
    _QueueManager.register("inbox")
    _QueueManager.register("outbox")
    _QueueManager.register("config")
    mgr = _QueueManager(address=hostport(router), authkey=authkey())
    deadline = time.monotonic() + 120
    while True:
        try:
            mgr.connect()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    proxies: Any = mgr  # the registered names exist at run time only
    cfg: WorkerConfig = proxies.config()._getvalue()
    return proxies.inbox(engine), proxies.outbox(), cfg
