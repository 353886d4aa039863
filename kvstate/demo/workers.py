"""The loop every worker process runs, whatever its role: one engine with its own KV
pool registered with a UCX transport and its own :class:`KVManager`. It takes jobs from
the router, polls every live room in one round trip, lets its role act on what changed
(``engines``), and reports results."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

import kvstate
from kvstate.demo.messages import (
    DEMO_OPTIONS,
    INTERRUPTED,
    Abort,
    Bye,
    Die,
    Job,
    Ready,
    Release,
    Result,
    Stop,
    WorkerConfig,
    WorkerFailed,
)
from kvstate.demo.pattern import Pool
from kvstate.demo.queues import Inbox, Outbox
from kvstate.errors import KVStateError
from kvstate.roles import KVReceiver, KVSender
from kvstate.stats import TransferRecorder
from kvstate.store import Store

if TYPE_CHECKING:
    from transports.ucx import UCXTransport

__all__ = ["Room", "Worker", "bootstrap_addr", "serve"]

log = logging.getLogger(__name__)

P = TypeVar("P", KVSender, KVReceiver)


def bootstrap_addr(engine: str) -> str:
    """The bootstrap address a prefill engine announces (used to bind receivers to it)."""
    return f"{engine}.{socket.gethostname()}:8998"


def _count_round_trips(store: Store) -> list[int]:
    """Count this worker's calls to ``Store.execute`` (one round trip each on a
    standalone server, one per node touched on a Cluster): the figure the summary
    reports per room. Returns the one-element counter the wrapper increments."""
    count = [0]
    execute = store.execute

    def counted(calls: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return execute(calls, *args, **kwargs)

    store.execute = counted  # type: ignore[method-assign]
    return count


@dataclass
class Room(Generic[P]):
    """One room a worker holds: its job, its sender or receiver, its pages."""

    job: Job
    part: P
    pages: np.ndarray | None = None
    aborted: bool = False
    ready_at: float | None = None  # prefill: when WaitingForInput was first seen (--hold)


class Worker(Generic[P]):
    """The loop both roles share: take jobs from the inbox, poll every live room in one
    round trip, act on what changed, report results to the router."""

    role = ""

    def __init__(self, cfg: WorkerConfig, engine: str, inbox: Inbox, outbox: Outbox) -> None:
        from transports.ucx import UCXTransport  # the core does not need UCX; the demo does

        self.cfg, self.engine, self.inbox, self.outbox = cfg, engine, inbox, outbox
        self.store = kvstate.connect(cfg.url, cfg.namespace, cfg.room_ttl, options=DEMO_OPTIONS)
        self.round_trips = _count_round_trips(self.store)
        self.pool = Pool(cfg, seed=zlib.crc32(engine.encode()))
        self.transport: UCXTransport = UCXTransport()
        self.transport.register_buffers(self.pool.layers, [cfg.page_bytes] * cfg.layers)
        self.addr = bootstrap_addr(engine)
        self.mgr = kvstate.KVManager(
            self.store,
            self.role,
            engine,
            self.addr,
            transport=self.transport,
            lease=cfg.lease,
            bootstrap_timeout=cfg.timeout,
            waiting_timeout=cfg.timeout,
            transfer_timeout=cfg.timeout,
        )
        self.recorder = TransferRecorder(self.store, engine)
        self.active: dict[int, Room[P]] = {}
        self.waiting: deque[Job] = deque()
        self.stopping = False
        self.abandon = False  # set by the router's Abort or by SIGTERM: clear and leave
        log.info(
            "%s: %s engine registered at %s in namespace %s (pool %d pages x %d layers)",
            engine,
            self.role,
            self.addr,
            cfg.namespace,
            cfg.pool_pages,
            cfg.layers,
        )

    def run(self) -> None:
        self.outbox.put(Ready(self.engine, self.role, self.addr, os.getpid(), socket.gethostname()))
        idle = 0
        while not (self.stopping and not self.active and not self.waiting):
            if self.abandon:
                self._abandon()
                break
            if self._drain(block=not self.active and not self.waiting):
                idle = 0
            self._start_waiting()
            if self.active and self._step():
                idle = 0
            elif self.active or self.waiting:  # waiting on the other side, or for pages
                # Poll again soon (the other side usually answers within a millisecond),
                # backing off to 2 ms so waiting rooms do not hammer Redis or the cores.
                idle += 1
                time.sleep(min(0.0001 * idle, 0.002))
            if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                return  # the router is gone: nobody reads our results
        self.recorder.flush()  # before Bye: the router reads the counters next
        stats = asdict(self.transport.stats)
        stats["cma_refused"] = bool(getattr(self.transport, "_no_cma", ()))
        stats["round_trips"] = self.round_trips[0]
        self.outbox.put(Bye(self.engine, stats))

    def _abandon(self) -> None:
        """Interrupted: clear every room this worker holds (no key is left on a shared
        Redis), report each as interrupted, and drop the jobs not started yet."""
        for room in list(self.active.values()):
            with contextlib.suppress(KVStateError):
                room.part.clear()
            self._report(room.job, "Failed", INTERRUPTED)
        self.active.clear()
        self.waiting.clear()
        log.info("%s: interrupted; cleared its rooms in flight", self.engine)

    def close(self) -> None:
        for room in list(self.active.values()):
            room.part.clear()
        self.recorder.close()
        self.mgr.close()
        self.transport.close()
        self.store.close()

    def _drain(self, block: bool) -> int:
        """Take every message waiting in the inbox (wait briefly for one if ``block``)."""
        n = 0
        while True:
            try:
                msg = self.inbox.get(timeout=0.05) if block else self.inbox.get(block=False)
            except queue.Empty:
                return n
            block = False
            n += 1
            match msg:
                case Job():
                    self.waiting.append(msg)
                case Release(room):
                    self._release(room)
                case Stop():
                    self.stopping = True
                case Abort():
                    self.abandon = True
                    return n
                case Die():  # fault injection when the router cannot signal us itself
                    os.kill(os.getpid(), signal.SIGKILL)

    def _report(self, job: Job, status: str, reason: str = "", **extra: Any) -> None:
        log.info(
            "%s: room %d %s%s", self.engine, job.room, status, f" ({reason})" if reason else ""
        )
        self.outbox.put(Result(job.room, self.role, self.engine, status, reason, **extra))

    def _fail(self, room: Room[P]) -> None:
        exc = room.part.failure_exception()  # reads the reason and clears
        room.part.clear()  # None (nothing cleared) had the room not failed
        self.active.pop(room.job.room, None)
        self._settle_failed(room)
        self._report(room.job, "Failed", exc.reason if exc else "not failed")

    # role hooks
    def _start_waiting(self) -> None:
        raise NotImplementedError

    def _step(self) -> bool:
        raise NotImplementedError

    def _settle_failed(self, room: Room[P]) -> None:
        pass

    def _release(self, room: int) -> None:
        pass


def serve(
    cls: type[Worker[Any]], cfg: WorkerConfig, engine: str, inbox: Inbox, outbox: Outbox
) -> int:
    """Run one worker; returns the signal that stopped it (0 if none).

    A worker spawned by the router (``parent_pid`` set) ignores SIGINT: Ctrl-C reaches
    the whole process group and the router alone decides the order of the shutdown. A
    worker started on its own (``--worker``) takes SIGINT like SIGTERM: it clears its
    rooms in flight, drops its lease and exits."""
    worker: Worker[Any] | None = None
    got = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal got
        if got:  # the second one: stop waiting
            raise KeyboardInterrupt
        got = signum
        if worker is not None:
            worker.abandon = True

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN if cfg.parent_pid else on_signal)
    try:
        worker = cls(cfg, engine, inbox, outbox)
        worker.abandon = bool(got)
        worker.run()
    except BaseException:
        if not got:
            outbox.put(WorkerFailed(engine, traceback.format_exc()))
            raise
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()
    return got
