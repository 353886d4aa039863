"""``kvstate demo``: the end-to-end run (docs/design.md, Zero setup).

The parent process is the *router*: it spawns prefill and decode workers, each
with its own KV pool registered with a :class:`UCXTransport` and its own
:class:`KVManager`, then pushes requests through them. Per room the router picks
a prefill and a decode worker and a room id and sends both the request over a
multiprocessing queue (the router's job in a real deployment); everything about
the room's *state* goes through Redis only. The decode worker checks every byte
of every page it received against a pattern derived from (room, page, layer), so
a success that moved the wrong bytes cannot pass.

Fault injection: ``--abort-rate`` aborts rooms mid-way (from the prefill side,
the decode side, or out of band with ``Store.abort``); ``--kill-prefill-after``
SIGKILLs a prefill worker and expects its in-flight rooms to fail, with a reason
naming the peer, through the decode side's lease watcher.

Workers are module-level functions (``prefill_worker``, ``decode_worker``) so the
``spawn`` start method can import them. For containers (docker-compose) the
router can serve its queues over TCP (``--listen``) and workers started as
``kvstate demo --worker prefill --engine prefill-0 --router HOST:PORT`` attach to
it; the bytes and the state then move exactly as in the one-machine run. Those queues
carry pickles, so both sides need the secret in ``$KVSTATE_DEMO_AUTHKEY``.

Operators: ``--hold`` keeps rooms visible to ``kvstate ls/show``, which find a running
demo's embedded server through its discovery record; SIGINT/SIGTERM make every worker
clear its rooms in flight before a partial summary (exit 130/143).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import queue
import random
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any, Protocol

import click
import numpy as np

from kvstate.connection import ENV_NAMESPACE, ENV_URL, redact
from kvstate.errors import KVStateError
from kvstate.ops.metrics import TransferRecorder, read_transfer_totals
from kvstate.poll import KVPoll

__all__ = ["decode_worker", "demo", "expected_pages", "prefill_worker"]

EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2
INTERRUPTED = "demo interrupted: the room was cleared in flight"
log = logging.getLogger(__name__)
ABORT_KINDS = ("prefill", "decode", "router")
_MASK = (1 << 64) - 1


# --------------------------------------------------------------------------- the pattern


def expected_pages(room: int, pages: np.ndarray, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes of logical pages ``pages`` of ``room`` in ``layer``: (n, page_bytes) uint8.

    Every 8-byte word differs within a page and between pages, layers and rooms, so
    a page written to the wrong place, shifted, or left stale fails the check."""
    words = page_bytes // 8
    base = (room * 0x9E3779B97F4A7C15 + (layer + 1) * 0xBF58476D1CE4E5B9) & _MASK
    seeds = np.uint64(base) + np.asarray(pages, dtype=np.uint64) * np.uint64(0x94D049BB133111EB)
    ramp = np.arange(words, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
    out = seeds[:, None] ^ ramp[None, :]
    return out.view(np.uint8).reshape(len(seeds), page_bytes)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs to build its pool, transport and manager."""

    url: str
    namespace: str
    page_bytes: int = 16384
    pool_pages: int = 1024
    layers: int = 2
    device: str = "cpu"
    lease: float = 10.0
    room_ttl: float = 60.0
    timeout: float = 30.0  # bootstrap, waiting and transfer timeouts
    parent_pid: int = 0  # exit when the router is gone (0: do not watch)
    hold: float = 0.0  # seconds a room waits in WaitingForInput before its transfer


@dataclass(frozen=True)
class Job:
    """One request, as the router hands it to both sides."""

    room: int
    pages: int
    prefill: str
    prefill_addr: str
    abort: str = ""  # which worker aborts it mid-way: "prefill", "decode" or ""


@dataclass(frozen=True)
class Result:
    """One side's outcome for one room."""

    room: int
    role: str
    engine: str
    status: str  # "Success" or "Failed"
    reason: str = ""
    verified: bool | None = None  # decode only: every byte matched
    bad_pages: int = 0
    nbytes: int = 0
    busy_s: float = 0.0  # prefill: inside send() (transfer + state); decode: verifying
    write_s: float = 0.0  # prefill: inside the transport's write (the bytes alone)


def _count_round_trips(store: Any) -> list[int]:
    """Count this worker's calls to ``Store.execute`` (one round trip each on a
    standalone server, one per node touched on a Cluster): the figure the summary
    reports per room. Returns the one-element counter the wrapper increments."""
    count = [0]
    execute = store.execute

    def counted(calls: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return execute(calls, *args, **kwargs)

    store.execute = counted
    return count


class _Queue(Protocol):
    def put(self, item: Any) -> None: ...
    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


def bootstrap_addr(engine: str) -> str:
    """The bootstrap address a prefill engine announces (used to bind receivers to it)."""
    return f"{engine}.{socket.gethostname()}:8998"


# --------------------------------------------------------------------------- KV pools


class Pool:
    """One engine's KV cache: ``layers`` arrays of ``pool_pages`` pages, host or GPU, and
    a free list. Pages are handed out from the front and returned to the back, so the
    indices of later requests are fragmented the way a real allocator's are."""

    def __init__(self, cfg: WorkerConfig, seed: int) -> None:
        self.cfg = cfg
        self.backend = _cuda_backend() if cfg.device == "cuda" else "numpy"
        shape = (cfg.pool_pages, cfg.page_bytes)
        self.layers: list[Any]
        if self.backend == "cupy":
            import cupy

            self.layers = [cupy.zeros(shape, dtype=cupy.uint8) for _ in range(cfg.layers)]
        elif self.backend == "torch":
            import torch

            self.layers = [
                torch.zeros(shape, dtype=torch.uint8, device="cuda") for _ in range(cfg.layers)
            ]
        else:
            self.layers = [np.zeros(shape, dtype=np.uint8) for _ in range(cfg.layers)]
        free = list(range(cfg.pool_pages))
        random.Random(seed).shuffle(free)
        self.free: deque[int] = deque(free)

    def alloc(self, n: int) -> np.ndarray | None:
        if n > len(self.free):
            return None
        return np.array([self.free.popleft() for _ in range(n)], dtype=np.int64)

    def release(self, pages: np.ndarray) -> None:
        self.free.extend(int(p) for p in pages)

    def fill(self, room: int, pages: np.ndarray) -> None:
        """Write the room's pattern into these pages (the prefill's 'forward pass')."""
        logical = np.arange(len(pages))
        for layer, arr in enumerate(self.layers):
            data = expected_pages(room, logical, layer, self.cfg.page_bytes)
            if self.backend == "numpy":
                arr[pages] = data
            elif self.backend == "cupy":
                import cupy

                arr[cupy.asarray(pages)] = cupy.asarray(data)
            else:
                import torch

                arr[torch.as_tensor(pages, device="cuda")] = torch.from_numpy(data).cuda()
        self._sync()  # UCX does not order itself after pending CUDA work

    def verify(self, room: int, pages: np.ndarray) -> int:
        """Number of pages (over all layers) whose bytes differ from the room's pattern."""
        bad = 0
        logical = np.arange(len(pages))
        for layer, arr in enumerate(self.layers):
            want = expected_pages(room, logical, layer, self.cfg.page_bytes)
            if self.backend == "numpy":
                got = arr[pages]
            elif self.backend == "cupy":
                import cupy

                got = cupy.asnumpy(arr[cupy.asarray(pages)])
            else:
                import torch

                got = arr[torch.as_tensor(pages, device="cuda")].cpu().numpy()
            diff = got.view(np.uint64) != want.view(np.uint64)  # 8 bytes per compare
            bad += int(np.count_nonzero(diff.any(axis=1)))
        return bad

    def _sync(self) -> None:
        if self.backend == "cupy":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        elif self.backend == "torch":
            import torch

            torch.cuda.synchronize()


def _cuda_backend() -> str:
    """'cupy' or 'torch' if one of them sees a CUDA device; a clear error otherwise."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:  # not installed, or no driver/device
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except Exception:
        pass
    raise KVStateError(
        "--device cuda needs a CUDA device and cupy or torch built with CUDA; none was "
        "found here (use --device cpu)"
    )


# --------------------------------------------------------------------------- workers


@dataclass
class _Room:
    job: Job
    part: Any  # KVSender or KVReceiver
    pages: np.ndarray | None = None
    aborted: bool = False
    ready_at: float | None = None  # prefill: when WaitingForInput was first seen (--hold)


class _Worker:
    """The loop both roles share: take jobs from the inbox, poll every live room in one
    round trip, act on what changed, report results to the router."""

    role = ""

    def __init__(self, cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> None:
        import kvstate
        from transports.ucx import UCXTransport

        self.cfg, self.engine, self.inbox, self.outbox = cfg, engine, inbox, outbox
        self.store = kvstate.connect(cfg.url, cfg.namespace, cfg.room_ttl)
        self.round_trips = _count_round_trips(self.store)
        self.pool = Pool(cfg, seed=zlib.crc32(engine.encode()))
        self.transport = UCXTransport()
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
        self.active: dict[int, _Room] = {}
        self.waiting: deque[Job] = deque()
        self.stopping = False
        self.abandon = False  # set by the router's "abort" or by SIGTERM: clear and leave
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
        self.outbox.put(
            ("ready", self.engine, self.role, self.addr, os.getpid(), socket.gethostname())
        )
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
        self.recorder.flush()  # before "bye": the router reads the counters next
        stats = asdict(self.transport.stats)
        stats["cma_refused"] = bool(getattr(self.transport, "_no_cma", ()))
        stats["round_trips"] = self.round_trips[0]
        self.outbox.put(("bye", self.engine, stats))

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
            kind = msg[0]
            if kind == "job":
                self.waiting.append(msg[1])
            elif kind == "release":
                self._release(msg[1])
            elif kind == "stop":
                self.stopping = True
            elif kind == "abort":
                self.abandon = True
                return n
            elif kind == "die":  # fault injection when the router cannot signal us itself
                os.kill(os.getpid(), signal.SIGKILL)

    def _report(self, job: Job, status: str, reason: str = "", **extra: Any) -> None:
        log.info(
            "%s: room %d %s%s", self.engine, job.room, status, f" ({reason})" if reason else ""
        )
        self.outbox.put(
            ("result", Result(job.room, self.role, self.engine, status, reason, **extra))
        )

    def _fail(self, room: _Room) -> None:
        exc = room.part.failure_exception()  # reads the reason and clears
        self.active.pop(room.job.room, None)
        self._settle_failed(room)
        self._report(room.job, "Failed", exc.reason)

    # role hooks
    def _start_waiting(self) -> None:
        raise NotImplementedError

    def _step(self) -> bool:
        raise NotImplementedError

    def _settle_failed(self, room: _Room) -> None:
        pass

    def _release(self, room: int) -> None:
        pass


class _Prefill(_Worker):
    """Creates a sender per job; once the receiver published its pages, 'computes' the
    KV (writes the pattern into source pages), sends and clears."""

    role = "prefill"

    def _start_waiting(self) -> None:
        while self.waiting:
            job = self.waiting.popleft()
            snd = self.mgr.sender(job.room, required_receivers=1)
            snd.init(job.pages)
            self.active[job.room] = _Room(job, snd)

    def _step(self) -> bool:
        progressed = False
        for room_id, status in self.mgr.poll_many(list(self.active)).items():
            room = self.active[room_id]
            if status == KVPoll.Failed:
                self._fail(room)
                progressed = True
            elif status >= KVPoll.WaitingForInput:
                if self.cfg.hold and self._holding(room):
                    continue
                if room.job.abort == "prefill":
                    room.part.abort("demo fault: prefill aborted the room mid-way")
                    self._fail(room)
                else:
                    self._send(room)
                progressed = True
        return progressed

    def _holding(self, room: _Room) -> bool:
        """--hold: keep the room in WaitingForInput (both sides published, nothing moved)
        for that long, so ``kvstate show`` / ``ls`` can catch it."""
        if room.ready_at is None:
            room.ready_at = time.monotonic()
        return time.monotonic() - room.ready_at < self.cfg.hold

    def _send(self, room: _Room) -> None:
        from transports.base import TransportError

        pages = self.pool.alloc(room.job.pages)
        if pages is None:  # pages come back as soon as each send returns
            raise KVStateError(
                f"{self.engine}: pool of {self.cfg.pool_pages} pages cannot hold "
                f"a {room.job.pages}-page request"
            )
        try:
            self.pool.fill(room.job.room, pages)
            t0 = time.perf_counter()
            writes = self.transport.stats.transfers
            try:
                status = room.part.send(pages, last=True)
            except (KVStateError, TransportError) as exc:
                status = room.part.fail(f"send failed: {exc}")
            busy = time.perf_counter() - t0
            stats = self.transport.stats
            write = stats.last_latency_s if stats.transfers > writes else 0.0
        finally:
            self.pool.release(pages)  # send() returns once the bytes are at the receiver
        if status == KVPoll.Success:
            room.part.clear()
            del self.active[room.job.room]
            nbytes = room.job.pages * self.cfg.page_bytes * self.cfg.layers
            if write:
                self.recorder.observe(nbytes, write)
            self._report(room.job, "Success", nbytes=nbytes, busy_s=busy, write_s=write)
        else:
            self._fail(room)


class _Decode(_Worker):
    """Allocates destination pages per job, publishes them, waits for Success, verifies
    every byte, clears. Pages of a failed room stay out of the free list until the router
    says the sender can no longer write into them (a one-sided put cannot be refused)."""

    role = "decode"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.quarantine: dict[int, np.ndarray] = {}

    def _start_waiting(self) -> None:
        while self.waiting:
            job = self.waiting[0]
            pages = self.pool.alloc(job.pages)
            if pages is None:
                return  # wait for pages of finished rooms
            self.waiting.popleft()
            # never raises for a prefill that is gone: the room fails with a reason
            rcv = self.mgr.receiver(job.room, job.prefill_addr)
            room = _Room(job, rcv, pages)
            self.active[job.room] = room
            if rcv.init(pages) == KVPoll.Failed:
                self._fail(room)

    def _step(self) -> bool:
        progressed = False
        for room_id, status in self.mgr.poll_many(list(self.active)).items():
            room = self.active[room_id]
            if status == KVPoll.Success:
                self._verify(room)
                progressed = True
            elif status == KVPoll.Failed:
                self._fail(room)
                progressed = True
            elif room.job.abort == "decode" and not room.aborted and self._sender_joined(room):
                room.aborted = True
                room.part.abort("demo fault: decode aborted the room mid-way")
                progressed = True
        return progressed

    def _sender_joined(self, room: _Room) -> bool:
        """Abort only once the sender exists, so the abort reaches both sides."""
        return any(m.startswith("tx:") for m in self.store.members(room.job.room))

    def _verify(self, room: _Room) -> None:
        assert room.pages is not None
        t0 = time.perf_counter()
        bad = self.pool.verify(room.job.room, room.pages)
        busy = time.perf_counter() - t0
        room.part.clear()
        del self.active[room.job.room]
        self.pool.release(room.pages)
        nbytes = room.job.pages * self.cfg.page_bytes * self.cfg.layers
        reason = f"{bad} page(s) differ from the pattern" if bad else ""
        self._report(
            room.job,
            "Success",
            reason,
            verified=bad == 0,
            bad_pages=bad,
            nbytes=nbytes,
            busy_s=busy,
        )

    def _settle_failed(self, room: _Room) -> None:
        if room.pages is not None:
            self.quarantine[room.job.room] = room.pages

    def _release(self, room: int) -> None:
        pages = self.quarantine.pop(room, None)
        if pages is not None:
            self.pool.release(pages)


def _serve(
    cls: type[_Worker], cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue
) -> int:
    """Run one worker; returns the signal that stopped it (0 if none).

    A worker spawned by the router (``parent_pid`` set) ignores SIGINT: Ctrl-C reaches
    the whole process group and the router alone decides the order of the shutdown. A
    worker started on its own (``--worker``) takes SIGINT like SIGTERM: it clears its
    rooms in flight, drops its lease and exits."""
    worker: _Worker | None = None
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
            outbox.put(("error", engine, traceback.format_exc()))
            raise
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()
    return got


def prefill_worker(cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> int:
    """Entry point of a prefill worker process (importable for ``spawn``)."""
    return _serve(_Prefill, cfg, engine, inbox, outbox)


def decode_worker(cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> int:
    """Entry point of a decode worker process (importable for ``spawn``)."""
    return _serve(_Decode, cfg, engine, inbox, outbox)


WORKERS: dict[str, Callable[[WorkerConfig, str, _Queue, _Queue], int]] = {
    "prefill": prefill_worker,
    "decode": decode_worker,
}


# --------------------------------------------------------------------------- remote queues


class _PipeOut:
    """A worker's own one-way channel to the router. One pipe per worker, not a shared
    Queue: a worker SIGKILLed while holding a shared queue's lock would stall the rest."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, item: Any) -> None:
        self.conn.send(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        raise NotImplementedError("the router reads this channel")


class _QueueManager(BaseManager):
    """Serves the router's queues over TCP so workers in other containers can attach."""


ENV_AUTHKEY = "KVSTATE_DEMO_AUTHKEY"
MIN_AUTHKEY_CHARS = 16
_PUBLIC_KEYS = frozenset({"kvstate-demo"})  # the old default, published in this repository


def _authkey() -> bytes:
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


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


class _RemoteQueues:
    """The router side of ``--listen``: one inbox per engine name, one shared outbox."""

    def __init__(self, listen: str, cfg: WorkerConfig) -> None:
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.inboxes: dict[str, queue.Queue[Any]] = {}
        self.lock = threading.Lock()

        def inbox(engine: str) -> queue.Queue[Any]:
            with self.lock:
                return self.inboxes.setdefault(engine, queue.Queue())

        mgr = _QueueManager(address=_hostport(listen), authkey=_authkey())
        mgr.register("inbox", callable=inbox)
        mgr.register("outbox", callable=lambda: self.outbox)
        mgr.register("config", callable=lambda: cfg)
        self.server = mgr.get_server()
        threading.Thread(
            target=self.server.serve_forever, name="kvstate-demo-queues", daemon=True
        ).start()


def _attach(router: str, engine: str) -> tuple[Any, Any, WorkerConfig]:
    """The worker side of ``--router``: our inbox, the outbox and the run's config."""
    _QueueManager.register("inbox")
    _QueueManager.register("outbox")
    _QueueManager.register("config")
    mgr = _QueueManager(address=_hostport(router), authkey=_authkey())
    deadline = time.monotonic() + 120
    while True:
        try:
            mgr.connect()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    cfg = mgr.config()._getvalue()  # type: ignore[attr-defined]
    return mgr.inbox(engine), mgr.outbox(), cfg  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- the router


@dataclass
class Options:
    """The run as the user asked for it."""

    requests: int = 100
    prefill_workers: int = 1
    decode_workers: int = 1
    pages_min: int = 4
    pages_max: int = 64
    inflight: int = 8
    abort_rate: float = 0.0
    kill_prefill_after: int | None = None
    seed: int | None = None
    listen: str | None = None


@dataclass
class _Track:
    """The router's view of one room: what it dispatched and what each side reported."""

    job: Job
    decode: str
    sent_at: float
    abort: str = ""
    results: dict[str, Result] = field(default_factory=dict)
    prefill_dead: bool = False
    done_at: float = 0.0

    @property
    def complete(self) -> bool:
        return "decode" in self.results and ("prefill" in self.results or self.prefill_dead)

    def outcome(self, killed: str | None) -> str:
        rx, tx = self.results.get("decode"), self.results.get("prefill")
        if rx is not None and rx.status == "Success" and not rx.verified:
            return "corrupt"
        cut = not self.complete or any(r.reason == INTERRUPTED for r in (rx, tx) if r)
        if cut and not (rx is not None and rx.status == "Success" and tx is not None):
            return "interrupted"
        failed = [r for r in (rx, tx) if r is not None and r.status == "Failed"]
        if not failed and (tx is not None or self.prefill_dead):
            return "done" if rx is not None and rx.verified else "failed"
        if self.abort and any("abort" in r.reason for r in failed):
            return "aborted"
        if killed is not None and self.job.prefill == killed:
            return "killed"
        return "failed"


class _Router:
    """Starts the workers, hands out rooms, injects faults and collects results. It never
    reads or writes room state except to inject an out-of-band abort."""

    def __init__(
        self, opts: Options, cfg: WorkerConfig, store: Any, signals: _Signals | None = None
    ) -> None:
        self.opts, self.cfg, self.store = opts, cfg, store
        self.signals = signals or _Signals()
        self.interrupted = 0  # the signal that stopped the run
        self.hosts: dict[str, str] = {}
        self.rng = random.Random(opts.seed)
        self.prefills = [f"prefill-{i}" for i in range(opts.prefill_workers)]
        self.decodes = [f"decode-{i}" for i in range(opts.decode_workers)]
        self.procs: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.inboxes: dict[str, Any] = {}
        self.readers: dict[Any, str] = {}  # one pipe per worker -> its engine
        self.buffer: deque[Any] = deque()
        self.addrs: dict[str, str] = {}
        self.remote: _RemoteQueues | None = None
        self.tracks: dict[int, _Track] = {}
        self.pending_oob: list[int] = []
        self.alive_prefills = list(self.prefills)
        self.killed: str | None = None
        self.stats: dict[str, dict[str, Any]] = {}
        self.finished = 0

    # -- workers ---------------------------------------------------------------
    def start(self) -> None:
        if self.opts.listen:
            self.remote = _RemoteQueues(self.opts.listen, self.cfg)
            click.echo(
                f"kvstate demo: waiting for workers {', '.join(self.prefills)}, "
                f"{', '.join(self.decodes)} (kvstate demo --worker ROLE --engine NAME "
                f"--router {self.opts.listen})",
                err=True,
            )
            for engine in self.prefills + self.decodes:
                self.inboxes[engine] = self.remote.inboxes.setdefault(engine, queue.Queue())
        else:
            ctx = multiprocessing.get_context("spawn")
            cfg = WorkerConfig(**{**asdict(self.cfg), "parent_pid": os.getpid()})
            # Children start with SIGINT ignored (inherited through exec) so a Ctrl-C during
            # their imports cannot print a traceback; they keep it ignored (see _serve).
            previous = (
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                if threading.current_thread() is threading.main_thread()
                else None
            )
            for engine in self.prefills + self.decodes:
                role = engine.split("-")[0]
                self.inboxes[engine] = ctx.Queue()
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=WORKERS[role],
                    name=f"kvstate-demo-{engine}",
                    args=(cfg, engine, self.inboxes[engine], _PipeOut(writer)),
                    daemon=True,
                )
                proc.start()
                writer.close()
                self.procs[engine] = proc
                self.readers[reader] = engine
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        wanted = set(self.prefills + self.decodes)
        deadline = time.monotonic() + (600 if self.opts.listen else 120)
        while wanted - set(self.addrs):
            msg = self._get(deadline)
            if msg[0] == "ready":
                _, engine, _, addr, pid, host = msg
                self.addrs[engine], self.pids[engine], self.hosts[engine] = addr, pid, host

    def _next(self) -> Any:
        """The next message from any worker, or None after a short wait."""
        if self.remote is not None:
            try:
                return self.remote.outbox.get(timeout=0.05)
            except queue.Empty:
                return None
        if not self.buffer:
            for conn in wait(list(self.readers), timeout=0.05):
                try:
                    self.buffer.append(conn.recv())  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):  # exited; the liveness check says how
                    del self.readers[conn]
        return self.buffer.popleft() if self.buffer else None

    def _get(self, deadline: float, interruptible: bool = True) -> Any:
        while True:
            if interruptible and self.signals.got:
                self.interrupted = self.signals.got
                raise _Interrupted
            msg = self._next()
            if msg is not None:
                if msg[0] == "error":
                    raise KVStateError(f"worker {msg[1]} failed:\n{msg[2]}")
                return msg
            for engine, proc in self.procs.items():
                if engine != self.killed and not proc.is_alive():
                    raise KVStateError(f"worker {engine} exited with status {proc.exitcode}")
            if time.monotonic() > deadline:
                raise KVStateError("timed out waiting for the workers (see their output above)")

    def stop(self) -> None:
        """Let every worker finish (or, once interrupted, clear its rooms in flight) and
        say goodbye with its transport stats; results that arrive meanwhile still count."""
        kind = "abort" if self.interrupted else "stop"
        for engine, inbox in self.inboxes.items():
            if engine != self.killed:
                inbox.put((kind,))
        deadline = time.monotonic() + (20 if self.interrupted else 60)
        # Interrupted before every worker attached: wait only for those that exist.
        expected = {
            e
            for e in self.inboxes
            if e != self.killed and (not self.interrupted or e in self.addrs or e in self.procs)
        }
        while expected - set(self.stats):
            try:
                msg = self._get(deadline, interruptible=False)
            except KVStateError:
                if not self.interrupted:
                    raise
                break  # a worker that died or did not answer: terminate() ends it
            if msg[0] == "bye":
                self.stats[msg[1]] = msg[2]
            elif msg[0] == "result" and msg[1].room in self.tracks:
                self.tracks[msg[1].room].results[msg[1].role] = msg[1]
        for proc in self.procs.values():
            proc.join(30)
        for inbox in self.inboxes.values():
            if hasattr(inbox, "close"):  # a spawn Queue: free its semaphores now
                inbox.close()
                inbox.join_thread()

    def terminate(self) -> None:
        """On error or Ctrl-C: no worker outlives the router."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    # -- rooms ---------------------------------------------------------------------
    def run(self, tick: Callable[[_Track], None]) -> float:
        """Push every request through; returns the seconds it took."""
        started = time.monotonic()
        backstop = self.cfg.timeout * 3 + self.cfg.lease * 3 + 30
        todo = self.opts.requests
        live: dict[int, _Track] = {}
        while todo or live:
            while todo and len(live) < self.opts.inflight:
                track = self._dispatch()
                live[track.job.room] = track
                todo -= 1
            self._maybe_kill(live, tick)
            self._fire_oob_aborts(live)
            try:
                msg = self._get(time.monotonic() + backstop)
            except _Interrupted:
                break
            except KVStateError as exc:
                if "timed out" in str(exc):
                    raise KVStateError(
                        f"{len(live)} room(s) got no result in {backstop:.0f} s: {sorted(live)[:5]}"
                    ) from None
                raise
            if msg[0] != "result":
                continue
            res: Result = msg[1]
            track = live.get(res.room) or self.tracks[res.room]
            track.results[res.role] = res
            self._after_result(track, live, tick)
        return time.monotonic() - started

    def _dispatch(self) -> _Track:
        room = self.rng.randrange(2**63)
        while room in self.tracks:
            room = self.rng.randrange(2**63)
        prefill = self.rng.choice(self.alive_prefills)
        decode = self.rng.choice(self.decodes)
        abort = ""
        if self.opts.abort_rate and self.rng.random() < self.opts.abort_rate:
            abort = self.rng.choice(ABORT_KINDS)
        pages = self.rng.randint(self.opts.pages_min, self.opts.pages_max)
        job = Job(
            room,
            pages,
            prefill,
            self.addrs[prefill],
            abort if abort in ("prefill", "decode") else "",
        )
        track = _Track(job, decode, time.monotonic(), abort)
        self.tracks[room] = track
        if abort == "router":
            self.pending_oob.append(room)
        self.inboxes[prefill].put(("job", job))
        self.inboxes[decode].put(("job", job))
        return track

    def _fire_oob_aborts(self, live: dict[int, _Track]) -> None:
        """``Store.abort`` from outside both engines, once both participants exist (an
        abort of a room nobody has created yet has nothing to fail)."""
        keep = []
        for room in self.pending_oob:
            track = live.get(room)
            if track is None or "decode" in track.results:
                continue
            members = self.store.members(room)
            if any(m.startswith("tx:") for m in members) and any(
                m.startswith("rx:") for m in members
            ):
                try:
                    if not self.store.abort(room, "demo fault: aborted out of band by the router"):
                        # Both sides finished between the check and the abort, which then
                        # failed nobody but left its mark: take the mark back (no side of
                        # this room will be created again), or it is a key left behind.
                        self.store.execute(
                            [self.store.command("DEL", self.store.keys.aborted(room))]
                        )
                    continue
                except KVStateError:  # the room kept changing: try again next tick
                    pass
            keep.append(room)
        self.pending_oob = keep

    def _after_result(
        self, track: _Track, live: dict[int, _Track], tick: Callable[[_Track], None]
    ) -> None:
        rx = track.results.get("decode")
        failed = rx is not None and rx.status == "Failed"
        tx_done = "prefill" in track.results or track.prefill_dead
        if failed and tx_done:  # the sender can no longer write into those pages
            self.inboxes[track.decode].put(("release", track.job.room))
        if track.complete and track.job.room in live:
            track.done_at = time.monotonic()
            del live[track.job.room]
            self.finished += 1
            tick(track)

    def _maybe_kill(self, live: dict[int, _Track], tick: Callable[[_Track], None]) -> None:
        n = self.opts.kill_prefill_after
        if n is None or self.killed is not None or self.finished < n:
            return
        # The prefill of the room dispatched last: it cannot have finished that room yet,
        # so the kill always leaves in-flight rooms to fail.
        busy = [t.job.prefill for t in live.values() if "prefill" not in t.results]
        victim = busy[-1] if busy else self.alive_prefills[0]
        if len(self.alive_prefills) == 1:
            raise KVStateError("--kill-prefill-after needs at least 2 prefill workers")
        self.killed = victim
        self.alive_prefills.remove(victim)
        proc = self.procs.get(victim)
        if proc is not None:
            conn = next(c for c, e in self.readers.items() if e == victim)
            while conn.poll():  # whole messages already sent are still results
                self.buffer.append(conn.recv())
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            # A write cut short by the kill would block a read forever: stop reading it.
            del self.readers[conn]
            self.inboxes[victim].cancel_join_thread()
        else:  # a remote worker: it kills itself
            self.inboxes[victim].put(("die",))
            time.sleep(1)
        for track in list(live.values()):
            if track.job.prefill == victim:
                track.prefill_dead = True
                self._after_result(track, live, tick)


# --------------------------------------------------------------------------- measuring


def _command_counts(store: Any) -> dict[str, int]:
    """Calls per command (INFO commandstats) summed over every primary."""

    out: dict[str, int] = {}
    for _, client in store.nodes():
        for name, stat in client.info("commandstats").items():
            cmd = name.removeprefix("cmdstat_")
            out[cmd] = out.get(cmd, 0) + int(stat["calls"])
    return out


def _keys_left(store: Any) -> list[str]:
    """Every key of the namespace except the ledger (a record of leaks, kept on purpose)."""
    return sorted(k for k in store.scan(store.keys.all_pattern) if k != store.keys.ledger)


def _wait_for_no_keys(store: Any, limit: float) -> tuple[list[str], float]:
    t0 = time.monotonic()
    left = _keys_left(store)
    while left and time.monotonic() - t0 < limit:
        time.sleep(0.25)
        left = _keys_left(store)
    return left, time.monotonic() - t0


def _audit(store: Any) -> dict[str, Any]:
    try:
        from kvstate.ops.audit import Auditor
    except ImportError:
        return {"result": "n/a"}
    report = Auditor(store, grace=0.0).run()
    doc = report.to_json()
    kinds = sorted({f["kind"] for f in doc["findings"]})
    doc["result"] = (
        "clean" if doc["clean"] else f"{len(doc['findings'])} finding(s): " + ", ".join(kinds)
    )
    return doc


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


# --------------------------------------------------------------------------- the command


def _pages_range(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise click.BadParameter(f"expected MIN-MAX page counts, got {value!r}") from None
    if a < 1 or b < a:
        raise click.BadParameter(f"need 1 <= MIN <= MAX, got {value!r}")
    return a, b


def _size(value: str) -> int:
    units = {"k": 1024, "kib": 1024, "m": 1 << 20, "mib": 1 << 20, "": 1, "b": 1}
    text = value.strip().lower()
    num = text.rstrip("kmib")
    try:
        n = int(num) * units[text[len(num) :]]
    except (ValueError, KeyError):
        raise click.BadParameter(f"expected a size like 16384, 16k or 1m, got {value!r}") from None
    if n < 64 or n % 64:
        raise click.BadParameter(f"page size must be a positive multiple of 64 bytes, got {n}")
    return n


class _Failure(click.ClickException):
    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"kvstate demo: error: {self.format_message()}", err=True)


@contextlib.contextmanager
def _errors(url: str | None) -> Iterator[None]:
    try:
        yield
    except (KVStateError, OSError) as exc:
        text = str(exc)
        if url:
            text = text.replace(url, redact(url))
        raise _Failure(text) from None


class _Interrupted(Exception):
    """Raised in the router's loops once SIGINT or SIGTERM arrived."""


class _Signals:
    """SIGINT (Ctrl-C) and SIGTERM (``docker stop``) in the router: the first one asks
    for an orderly stop (workers clear their rooms in flight, a partial summary is
    printed, the exit status is 128 + the signal); a second one stops waiting."""

    def __init__(self) -> None:
        self.got = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame: Any) -> None:
        if self.got:
            raise KeyboardInterrupt
        self.got = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- discovery


def discovery_path(pid: int | None = None) -> Path:
    """Where a running demo announces its embedded Redis: ``kvstate show`` / ``ls`` read
    ``${XDG_RUNTIME_DIR:-/tmp}/kvstate-demo-<pid>.json`` ({"url", "namespace", "pid"})."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"kvstate-demo-{os.getpid() if pid is None else pid}.json"


@contextlib.contextmanager
def _announced(url: str, namespace: str) -> Iterator[Path]:
    """Write the discovery record for the run's lifetime (mode 0600), remove it after.
    Only the embedded server is announced: its unix URL holds no secret."""
    path = discovery_path()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "namespace": namespace, "pid": os.getpid()}, f)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# --------------------------------------------------------------------------- the command


@click.command()
@click.option(
    "--url",
    metavar="URL",
    help=f"Redis URL (else ${ENV_URL}, else an embedded "
    f"redis-server started for this run). A password here shows in `ps`: prefer "
    f"${ENV_URL}.",
)
@click.option(
    "--namespace",
    metavar="NS",
    help=f"kvstate namespace (else ${ENV_NAMESPACE}, "
    "else demo-<random>, so a shared Redis keeps runs apart).",
)
@click.option(
    "--requests",
    "n_requests",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Rooms to push through.",
)
@click.option("--prefill-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--decode-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--pages-per-request",
    default="4-64",
    show_default=True,
    metavar="MIN-MAX",
    help="Random request length in pages.",
)
@click.option(
    "--page-bytes",
    default="16k",
    show_default=True,
    help="Bytes per page per layer (16k, 4096, 1m).",
)
@click.option(
    "--pool-pages",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Pages in each worker's KV pool.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="KV buffers per worker (one registered array each).",
)
@click.option(
    "--inflight",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Rooms the router keeps in flight.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the KV pools live.",
)
@click.option(
    "--abort-rate",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Fraction of rooms aborted mid-way by the prefill side, the decode side "
    "or out of band (Store.abort).",
)
@click.option(
    "--kill-prefill-after",
    type=click.IntRange(min=0),
    metavar="N",
    help="SIGKILL one prefill worker after N rooms completed.",
)
@click.option(
    "--lease",
    type=click.FloatRange(min=0.1),
    help="Engine lease in seconds [default: 2 with --kill-prefill-after, else 10].",
)
@click.option(
    "--room-ttl",
    type=click.FloatRange(min=1.0),
    help="Room key TTL in seconds "
    "[default: 8 with --kill-prefill-after, else 60; at least --hold + 60].",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=30.0,
    show_default=True,
    help="Bootstrap, waiting and transfer timeouts of the workers' rooms "
    "(raised to --hold + 30 when that is longer).",
)
@click.option(
    "--hold",
    type=click.FloatRange(min=0.0),
    default=0.0,
    metavar="SECONDS",
    help="Keep each room in WaitingForInput this long before its transfer, so "
    "`kvstate ls` / `show` can catch it (rooms otherwise live ~50 ms).",
)
@click.option("--seed", type=int, help="Seed for rooms, lengths, workers and faults.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help="Serve the queues over TCP and wait for "
    "workers prefill-0.. and decode-0.. started with --worker/--router "
    f"(docker-compose) instead of spawning them. Needs ${ENV_AUTHKEY}.",
)
@click.option(
    "--worker",
    type=click.Choice(["prefill", "decode"]),
    help="Run one worker attached to a router started with --listen.",
)
@click.option("--engine", help="Engine id of this worker (with --worker), e.g. prefill-0.")
@click.option(
    "--router",
    metavar="HOST:PORT",
    help=f"The router to attach to (with --worker; needs ${ENV_AUTHKEY}, the router's secret).",
)
@click.pass_context
def demo(
    ctx: click.Context,
    url: str | None,
    namespace: str | None,
    n_requests: int,
    prefill_workers: int,
    decode_workers: int,
    pages_per_request: str,
    page_bytes: str,
    pool_pages: int,
    layers: int,
    inflight: int,
    device: str,
    abort_rate: float,
    kill_prefill_after: int | None,
    lease: float | None,
    room_ttl: float | None,
    timeout: float,
    hold: float,
    seed: int | None,
    as_json: bool,
    listen: str | None,
    worker: str | None,
    engine: str | None,
    router: str | None,
) -> None:
    """Run a real disaggregated transfer end to end: Redis state, UCX bytes, every byte
    verified, every key gone. Exit 0 only if all of that held; 130 / 143 when stopped by
    SIGINT / SIGTERM (rooms in flight cleared, partial summary printed)."""
    url, namespace = _inherit(ctx, url, namespace)
    if worker is not None:
        if not engine or not router:
            raise click.UsageError("--worker needs --engine and --router")
        with _errors(url):
            _authkey()
            got = _run_attached(worker, engine, router, url, namespace)
        ctx.exit(128 + got if got else 0)
    lo, hi = _pages_range(pages_per_request)
    pb = _size(page_bytes)
    if hi > pool_pages:
        raise click.BadParameter(
            f"{hi} pages per request do not fit a pool of {pool_pages}",
            param_hint="--pages-per-request",
        )
    if kill_prefill_after is not None and prefill_workers < 2:
        raise click.UsageError("--kill-prefill-after needs --prefill-workers 2 or more")
    if listen:
        with _errors(url):
            _authkey()
    killing = kill_prefill_after is not None
    lease = lease if lease is not None else (2.0 if killing else 10.0)
    room_ttl = room_ttl if room_ttl is not None else (8.0 if killing else 60.0)
    if hold:
        timeout = max(timeout, hold + 30.0)
        room_ttl = max(room_ttl, hold + 60.0)
    if device == "cuda":
        with _errors(url):
            _cuda_backend()
    opts = Options(
        n_requests,
        prefill_workers,
        decode_workers,
        lo,
        hi,
        inflight,
        abort_rate,
        kill_prefill_after,
        seed,
        listen,
    )
    with _errors(url):
        code = _run(
            opts,
            url,
            namespace or f"demo-{secrets.token_hex(3)}",
            WorkerConfig(
                "", "", pb, pool_pages, layers, device, lease, room_ttl, timeout, hold=hold
            ),
            as_json,
        )
    ctx.exit(code)


def _inherit(
    ctx: click.Context, url: str | None, namespace: str | None
) -> tuple[str | None, str | None]:
    """Under ``kvstate demo`` the group's --url/--namespace count too."""
    parent = ctx.parent
    if parent is not None:
        url = url or parent.params.get("url")
        src = parent.get_parameter_source("namespace")
        if namespace is None and src is not None and src.name != "DEFAULT":
            namespace = parent.params.get("namespace")
    url = url or os.environ.get(ENV_URL) or None
    namespace = namespace or os.environ.get(ENV_NAMESPACE) or None
    return url, namespace


def _run_attached(
    role: str, engine: str, router: str, url: str | None, namespace: str | None
) -> int:
    """A worker in its own container: logs what it does (``docker compose logs``);
    returns the signal that stopped it, 0 if the router said stop."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("KVSTATE_LOG_LEVEL", "INFO").upper(),
            format="%(asctime)s %(levelname)s %(message)s",
        )
    log.info("%s: attaching to router %s", engine, router)
    inbox, outbox, cfg = _attach(router, engine)
    over = {k: v for k, v in (("url", url), ("namespace", namespace)) if v}
    cfg = WorkerConfig(**{**asdict(cfg), **over, "parent_pid": 0})
    got = WORKERS[role](cfg, engine, inbox, outbox)
    log.info("%s: %s", engine, f"stopped by {signal.Signals(got).name}" if got else "done")
    return got


def _banner(
    store: Any, cfg: WorkerConfig, opts: Options, embedded: bool, record: Path | None
) -> None:
    """Where the run's state lives and how to look at it while it runs (plain lines on
    stderr, never wrapped, so the commands can be copied)."""

    def say(text: str) -> None:
        click.echo(text, err=True)

    where = "embedded, stops with the demo" if embedded else "given"
    say(
        f"kvstate demo: Redis {store.url} ({where}), namespace {store.namespace}; "
        f"{opts.prefill_workers} prefill + {opts.decode_workers} decode worker(s), "
        f"{opts.requests} requests"
    )
    ns = store.namespace
    if record is not None:
        say(
            f"  inspect while it runs: kvstate ls  /  kvstate show ROOM  (they find this run "
            f"through {record})"
        )
        say(f"  or name it: kvstate --url {store.url} --namespace {ns} ls")
    else:
        say(f"  inspect while it runs: kvstate --url URL --namespace {ns} ls  /  show ROOM")
        say(
            f"  (URL: {store.url}; with a password, export {ENV_URL} rather than pass --url, "
            "which `ps` shows)"
        )
    if cfg.hold:
        say(f"  each room waits {cfg.hold:g} s in WaitingForInput before its transfer (--hold)")
    else:
        say("  rooms live ~50 ms: add --hold 30 to keep each one visible for 30 s")


def _run(opts: Options, url: str | None, namespace: str, base: WorkerConfig, as_json: bool) -> int:
    import kvstate
    from kvstate import embedded

    real_url = url or embedded.ensure_server()
    store = kvstate.connect(real_url, namespace, base.room_ttl)
    cfg = WorkerConfig(**{**asdict(base), "url": real_url, "namespace": store.namespace})
    err = _console(stderr=True)
    announce = (
        _announced(real_url, store.namespace) if url is None else contextlib.nullcontext(None)
    )
    with announce as record, _Signals() as signals:
        _banner(store, cfg, opts, url is None, record)
        rtr = _Router(opts, cfg, store, signals)
        counts: dict[str, int] = {}
        seconds = 0.0
        before: dict[str, int] = {}
        try:
            try:
                rtr.start()
                before = _command_counts(store)
                seconds = _progress(rtr, err, counts, as_json)
            except _Interrupted:
                pass
            rtr.stop()
        except BaseException:
            rtr.terminate()
            raise
        rtr.terminate()  # a worker that did not say goodbye in time
        after = _command_counts(store) if before else {}
        counters = _take_transfer_counters(store, rtr)
        wait = cfg.room_ttl + cfg.lease + 5 if rtr.killed else cfg.lease + 2
        left, waited = _wait_for_no_keys(store, wait)
        audit = _audit(store) if not rtr.interrupted else {"result": "skipped (interrupted)"}
        doc = _summary(opts, cfg, rtr, seconds, before, after, left, waited, audit, counters)
    store.close()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_summary(doc)
    if rtr.interrupted:
        return 128 + rtr.interrupted
    return 0 if doc["ok"] else EXIT_CHECK_FAILED


def _progress(rtr: _Router, err: Any, counts: dict[str, int], as_json: bool) -> float:
    """Run the rooms under a progress bar; returns the seconds they took."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("rooms"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=err,
        transient=as_json,
    ) as progress:
        task = progress.add_task("rooms", total=rtr.opts.requests, counts="")

        def tick(track: _Track) -> None:
            kind = track.outcome(rtr.killed)
            counts[kind] = counts.get(kind, 0) + 1
            progress.update(
                task, advance=1, counts=" ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            )

        return rtr.run(tick)


def _take_transfer_counters(store: Any, rtr: _Router) -> dict[str, dict[str, Any]]:
    """The transfer counters the workers published for the monitor, as the monitor
    would export them; then deleted, so the demo leaves no key behind."""
    totals = {
        e: t
        for e, t in read_transfer_totals(store).items()
        if e in rtr.prefills or e in rtr.decodes
    }
    if totals:
        store.execute([store.command("DEL", store.keys.transfer_stats(e)) for e in totals])
    return {
        e: {"bytes": t.bytes, "transfers": t.count, "seconds": round(t.seconds, 4)}
        for e, t in totals.items()
    }


def _write_path(rtr: _Router) -> str:
    """Which data path moved the bytes: kvstate's transport writes same-host host memory
    with process_vm_writev (CMA) and everything else with UCX puts."""
    hosts = {rtr.hosts.get(e) for e in rtr.prefills + rtr.decodes}
    refused = any(s.get("cma_refused") for s in rtr.stats.values())
    cma_on = os.environ.get("KVSTATE_UCX_CMA", "1").strip().lower() not in (
        "0",
        "n",
        "no",
        "false",
        "off",
    )
    if rtr.cfg.device == "cpu" and len(hosts) == 1 and cma_on and not refused:
        return "CMA"
    return "UCX"


def _summary(
    opts: Options,
    cfg: WorkerConfig,
    rtr: _Router,
    seconds: float,
    before: dict[str, int],
    after: dict[str, int],
    left: list[str],
    waited: float,
    audit: dict[str, Any],
    counters: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    rooms = []
    outcomes: dict[str, int] = {
        "done": 0,
        "failed": 0,
        "aborted": 0,
        "killed": 0,
        "corrupt": 0,
        "interrupted": 0,
    }
    latencies: list[float] = []
    nbytes = 0
    send_s = write_s = verify_s = 0.0
    for track in rtr.tracks.values():
        kind = track.outcome(rtr.killed)
        outcomes[kind] = outcomes.get(kind, 0) + 1
        rx, tx = track.results.get("decode"), track.results.get("prefill")
        if kind == "done" and rx is not None:
            latencies.append((track.done_at - track.sent_at) * 1000)
            nbytes += rx.nbytes
            verify_s += rx.busy_s
            send_s += tx.busy_s if tx is not None else 0.0
            write_s += tx.write_s if tx is not None else 0.0
        rooms.append(
            {
                "room": track.job.room,
                "outcome": kind,
                "pages": track.job.pages,
                "prefill": track.job.prefill,
                "decode": track.decode,
                "abort": track.abort,
                "verified": rx.verified if rx is not None else None,
                "bad_pages": rx.bad_pages if rx is not None else 0,
                "decode_status": rx.status if rx is not None else None,
                "decode_reason": rx.reason if rx is not None else "",
                "prefill_status": tx.status
                if tx is not None
                else ("killed" if track.prefill_dead else None),
                "prefill_reason": tx.reason if tx is not None else "",
            }
        )
    injected = [t.abort for t in rtr.tracks.values() if t.abort]
    aborts = {
        "injected": len(injected),
        "landed": outcomes["aborted"],
        "by": {k: injected.count(k) for k in ABORT_KINDS},
    }
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k != "info"}
    by_command = dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -kv[1]))
    calls = sum(by_command.values())
    dispatched = max(1, len(rtr.tracks))
    trips = sum(int(s.get("round_trips", 0)) for s in rtr.stats.values())
    unexpected = outcomes["failed"] + outcomes["corrupt"]
    verified = all(r["verified"] for r in rooms if r["decode_status"] == "Success")
    ok = verified and not left and unexpected == 0 and not rtr.interrupted
    send_gbps = round(nbytes / send_s / 1e9, 3) if send_s else 0.0
    write_gbps = round(nbytes / write_s / 1e9, 3) if write_s else 0.0
    return {
        "ok": ok,
        "interrupted": signal.Signals(rtr.interrupted).name if rtr.interrupted else None,
        "requests": opts.requests,
        "dispatched": len(rtr.tracks),
        "outcomes": outcomes,
        "aborts": aborts,
        "all_success_verified": verified,
        "bytes_verified": nbytes,
        "seconds": round(seconds, 3),
        # verified bytes over the run's wall time (waiting, pattern filling and
        # verifying included): what the whole pipeline sustained
        "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
        # the same bytes over the time prefill workers spent inside send(): the write
        # plus the two state transitions (begin, finish) in Redis
        "send_gb_per_s": send_gbps,
        # the same bytes over the time inside the transport's write alone (the data
        # plane), by the path named in write_path
        "write_gb_per_s": write_gbps,
        "write_path": _write_path(rtr),
        # share of the time inside send() that was not the write: the state's cost
        "state_share_of_send": round(1 - write_s / send_s, 3) if send_s and write_s else 0.0,
        "verify_s": round(verify_s, 3),
        "latency_ms": {
            "p50": round(_percentile(latencies, 50), 2),
            "p99": round(_percentile(latencies, 99), 2),
            "max": round(max(latencies, default=0.0), 2),
        },
        "redis": {
            "url": redact(cfg.url),
            "namespace": cfg.namespace,
            # calls to Store.execute by the workers (one round trip each on a standalone
            # server): both sides, polls while waiting and heartbeats included
            "round_trips": trips,
            "round_trips_per_room": round(trips / dispatched, 1),
            # commands Redis executed (INFO commandstats), those inside scripts included
            "commands": calls,
            "commands_per_room": round(calls / dispatched, 1),
            "by_command": by_command,
        },
        "transfer_counters": counters,
        "keys_left": len(left),
        "keys_left_sample": left[:10],
        "waited_for_keys_s": round(waited, 2),
        "audit": audit,
        "killed": rtr.killed,
        "workers": {
            "prefill": opts.prefill_workers,
            "decode": opts.decode_workers,
            "transport": rtr.stats,
        },
        "config": {
            "page_bytes": cfg.page_bytes,
            "pool_pages": cfg.pool_pages,
            "layers": cfg.layers,
            "pages_per_request": [opts.pages_min, opts.pages_max],
            "device": cfg.device,
            "lease_s": cfg.lease,
            "room_ttl_s": cfg.room_ttl,
            "hold_s": cfg.hold,
            "abort_rate": opts.abort_rate,
            "kill_prefill_after": opts.kill_prefill_after,
            "seed": opts.seed,
        },
        "rooms": rooms,
    }


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(stderr=stderr, width=width, highlight=False)


_PATHS = {"CMA": "CMA (process_vm_writev, same host)", "UCX": "UCX puts"}


def _print_summary(doc: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    o = doc["outcomes"]
    t = Table(title="kvstate demo", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row(
        "rooms",
        f"{doc['requests']} requested, {doc['dispatched']} dispatched: "
        f"done {o['done']}, failed {o['failed']}, aborted {o['aborted']}, "
        f"killed-peer {o['killed']}, corrupt {o['corrupt']}"
        + (f", interrupted {o['interrupted']}" if o["interrupted"] else ""),
    )
    a = doc["aborts"]
    if a["injected"]:
        by = ", ".join(f"{k} {v}" for k, v in a["by"].items())
        t.add_row(
            "aborts",
            f"{a['injected']} injected ({by}); {a['landed']} landed, the rest finished first",
        )
    t.add_row(
        "bytes verified",
        f"{doc['bytes_verified'] / 1e6:.1f} MB "
        f"({'all successful rooms match' if doc['all_success_verified'] else 'MISMATCH'})",
    )
    t.add_row(
        "end to end",
        f"{doc['gb_per_s']:.3f} GB/s: verified bytes / {doc['seconds']:.2f} s "
        "of wall time (waiting, filling and verifying pages included)",
    )
    path = _PATHS.get(doc["write_path"], doc["write_path"])
    t.add_row(
        "data plane",
        f"{doc['write_gb_per_s']:.2f} GB/s: the same bytes / time inside "
        f"the transport's write alone, via {path}",
    )
    t.add_row(
        "send() call",
        f"{doc['send_gb_per_s']:.2f} GB/s: the same bytes / time inside "
        f"send() = that write + 2 Redis state transitions; "
        f"{doc['state_share_of_send']:.0%} of it outside the write",
    )
    lat = doc["latency_ms"]
    t.add_row(
        "room latency",
        f"p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms "
        "(router dispatch to both sides' results)",
    )
    r = doc["redis"]
    t.add_row(
        "redis per room",
        f"{r['round_trips_per_room']} round trips from the workers "
        "(both sides; polls while waiting and heartbeats included, a poll_many shared "
        f"by the rooms it covers; one room alone: 7); {r['commands_per_room']} commands "
        "Redis executed (script internals included)",
    )
    t.add_row(
        "keys left",
        f"{doc['keys_left']}"
        + (f" after {doc['waited_for_keys_s']:.1f} s" if doc["waited_for_keys_s"] >= 0.5 else ""),
    )
    t.add_row("audit", escape(doc["audit"]["result"]))
    if doc["killed"]:
        lost = [r for r in doc["rooms"] if r["outcome"] == "killed"]
        why = f"; e.g. {escape(lost[0]['decode_reason'])}" if lost else ""
        t.add_row("killed", f"{doc['killed']} (SIGKILL), {len(lost)} room(s) in flight{why}")
    if doc["interrupted"]:
        t.add_row(
            "result",
            f"[yellow]INTERRUPTED[/yellow] by {doc['interrupted']}: partial "
            f"run, {o['interrupted']} room(s) in flight cleared",
        )
    else:
        t.add_row("result", "[green]OK[/green]" if doc["ok"] else "[red]FAILED[/red]")
    out = _console()
    out.print(t)
    for room in doc["rooms"]:
        if room["outcome"] in ("failed", "corrupt"):
            out.print(
                f"  room {room['room']}: {room['outcome']}: "
                f"{escape(room['decode_reason'] or room['prefill_reason'])}"
            )
    for key in doc["keys_left_sample"]:
        out.print(f"  key left: {escape(key)}")


if __name__ == "__main__":
    demo()
