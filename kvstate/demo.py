"""``kvstate demo``: the end-to-end run (SPEC section 7).

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
it; the bytes and the state then move exactly as in the one-machine run.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any, Protocol

import click
import numpy as np

from kvstate.connection import ENV_NAMESPACE, ENV_URL, redact
from kvstate.errors import KVStateError, PeerNotFoundError
from kvstate.poll import KVPoll

__all__ = ["decode_worker", "demo", "expected_pages", "prefill_worker"]

EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2
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

            self.layers = [torch.zeros(shape, dtype=torch.uint8, device="cuda")
                           for _ in range(cfg.layers)]
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


class _Worker:
    """The loop both roles share: take jobs from the inbox, poll every live room in one
    round trip, act on what changed, report results to the router."""

    role = ""

    def __init__(self, cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> None:
        import kvstate
        from transports.ucx import UCXTransport

        self.cfg, self.engine, self.inbox, self.outbox = cfg, engine, inbox, outbox
        self.store = kvstate.connect(cfg.url, cfg.namespace, cfg.room_ttl)
        self.pool = Pool(cfg, seed=zlib.crc32(engine.encode()))
        self.transport = UCXTransport()
        self.transport.register_buffers(self.pool.layers, [cfg.page_bytes] * cfg.layers)
        self.addr = bootstrap_addr(engine)
        self.mgr = kvstate.KVManager(
            self.store, self.role, engine, self.addr, transport=self.transport,
            lease=cfg.lease, bootstrap_timeout=cfg.timeout, waiting_timeout=cfg.timeout,
            transfer_timeout=cfg.timeout,
        )
        self.active: dict[int, _Room] = {}
        self.waiting: deque[Job] = deque()
        self.stopping = False

    def run(self) -> None:
        self.outbox.put(("ready", self.engine, self.role, self.addr, os.getpid()))
        idle = 0
        while not (self.stopping and not self.active and not self.waiting):
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
        self.outbox.put(("bye", self.engine, asdict(self.transport.stats)))

    def close(self) -> None:
        for room in list(self.active.values()):
            room.part.clear()
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
            elif kind == "die":  # fault injection when the router cannot signal us itself
                os.kill(os.getpid(), signal.SIGKILL)

    def _report(self, job: Job, status: str, reason: str = "", **extra: Any) -> None:
        self.outbox.put(("result", Result(job.room, self.role, self.engine, status, reason,
                                          **extra)))

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
                if room.job.abort == "prefill":
                    room.part.abort("demo fault: prefill aborted the room mid-way")
                    self._fail(room)
                else:
                    self._send(room)
                progressed = True
        return progressed

    def _send(self, room: _Room) -> None:
        from transports.base import TransportError

        pages = self.pool.alloc(room.job.pages)
        if pages is None:  # pages come back as soon as each send returns
            raise KVStateError(f"{self.engine}: pool of {self.cfg.pool_pages} pages cannot hold "
                               f"a {room.job.pages}-page request")
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
            try:
                rcv = self.mgr.receiver(job.room, job.prefill_addr)
            except PeerNotFoundError as exc:  # the prefill engine is already gone
                self.pool.release(pages)
                self._report(job, "Failed", f"{job.prefill}: {exc}")
                continue
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
        self._report(room.job, "Success", reason, verified=bad == 0, bad_pages=bad,
                     nbytes=nbytes, busy_s=busy)

    def _settle_failed(self, room: _Room) -> None:
        if room.pages is not None:
            self.quarantine[room.job.room] = room.pages

    def _release(self, room: int) -> None:
        pages = self.quarantine.pop(room, None)
        if pages is not None:
            self.pool.release(pages)


def _serve(cls: type[_Worker], cfg: WorkerConfig, engine: str, inbox: _Queue,
           outbox: _Queue) -> None:
    worker = None
    try:
        worker = cls(cfg, engine, inbox, outbox)
        worker.run()
    except BaseException:
        outbox.put(("error", engine, traceback.format_exc()))
        raise
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()


def prefill_worker(cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> None:
    """Entry point of a prefill worker process (importable for ``spawn``)."""
    _serve(_Prefill, cfg, engine, inbox, outbox)


def decode_worker(cfg: WorkerConfig, engine: str, inbox: _Queue, outbox: _Queue) -> None:
    """Entry point of a decode worker process (importable for ``spawn``)."""
    _serve(_Decode, cfg, engine, inbox, outbox)


WORKERS: dict[str, Callable[[WorkerConfig, str, _Queue, _Queue], None]] = {
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


def _authkey() -> bytes:
    return os.environ.get("KVSTATE_DEMO_AUTHKEY", "kvstate-demo").encode()


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
        threading.Thread(target=self.server.serve_forever, name="kvstate-demo-queues",
                         daemon=True).start()


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

    def __init__(self, opts: Options, cfg: WorkerConfig, store: Any) -> None:
        self.opts, self.cfg, self.store = opts, cfg, store
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
            click.echo(f"kvstate demo: waiting for workers {', '.join(self.prefills)}, "
                       f"{', '.join(self.decodes)} (kvstate demo --worker ROLE --engine NAME "
                       f"--router {self.opts.listen})", err=True)
            for engine in self.prefills + self.decodes:
                self.inboxes[engine] = self.remote.inboxes.setdefault(engine, queue.Queue())
        else:
            ctx = multiprocessing.get_context("spawn")
            cfg = WorkerConfig(**{**asdict(self.cfg), "parent_pid": os.getpid()})
            for engine in self.prefills + self.decodes:
                role = engine.split("-")[0]
                self.inboxes[engine] = ctx.Queue()
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=WORKERS[role], name=f"kvstate-demo-{engine}",
                                   args=(cfg, engine, self.inboxes[engine], _PipeOut(writer)),
                                   daemon=True)
                proc.start()
                writer.close()
                self.procs[engine] = proc
                self.readers[reader] = engine
        wanted = set(self.prefills + self.decodes)
        deadline = time.monotonic() + (600 if self.opts.listen else 120)
        while wanted - set(self.addrs):
            msg = self._get(deadline)
            if msg[0] == "ready":
                _, engine, _, addr, pid = msg
                self.addrs[engine], self.pids[engine] = addr, pid

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

    def _get(self, deadline: float) -> Any:
        while True:
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
        for engine, inbox in self.inboxes.items():
            if engine != self.killed:
                inbox.put(("stop",))
        deadline = time.monotonic() + 60
        while {e for e in self.inboxes if e != self.killed} - set(self.stats):
            msg = self._get(deadline)
            if msg[0] == "bye":
                self.stats[msg[1]] = msg[2]
        for proc in self.procs.values():
            proc.join(30)

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
            except KVStateError as exc:
                if "timed out" in str(exc):
                    raise KVStateError(f"{len(live)} room(s) got no result in {backstop:.0f} s: "
                                       f"{sorted(live)[:5]}") from None
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
        job = Job(room, pages, prefill, self.addrs[prefill],
                  abort if abort in ("prefill", "decode") else "")
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
            if any(m.startswith("tx:") for m in members) and \
                    any(m.startswith("rx:") for m in members):
                try:
                    self.store.abort(room, "demo fault: aborted out of band by the router")
                    continue
                except KVStateError:  # the room kept changing: try again next tick
                    pass
            keep.append(room)
        self.pending_oob = keep

    def _after_result(self, track: _Track, live: dict[int, _Track],
                      tick: Callable[[_Track], None]) -> None:
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
        from kvstate.audit import Auditor
    except ImportError:
        return {"result": "n/a"}
    report = Auditor(store, grace=0.0).run()
    doc = report.to_json()
    kinds = sorted({f["kind"] for f in doc["findings"]})
    doc["result"] = "clean" if doc["clean"] else f"{len(doc['findings'])} finding(s): " \
        + ", ".join(kinds)
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
        n = int(num) * units[text[len(num):]]
    except (ValueError, KeyError):
        raise click.BadParameter(f"expected a size like 16384, 16k or 1m, got {value!r}") \
            from None
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


@click.command()
@click.option("--url", metavar="URL", help=f"Redis URL (else ${ENV_URL}, else an embedded "
              "redis-server started for this run).")
@click.option("--namespace", metavar="NS", help=f"kvstate namespace (else ${ENV_NAMESPACE}, "
              "else demo-<random>, so a shared Redis keeps runs apart).")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=100,
              show_default=True, help="Rooms to push through.")
@click.option("--prefill-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--decode-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pages-per-request", default="4-64", show_default=True, metavar="MIN-MAX",
              help="Random request length in pages.")
@click.option("--page-bytes", default="16k", show_default=True,
              help="Bytes per page per layer (16k, 4096, 1m).")
@click.option("--pool-pages", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Pages in each worker's KV pool.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="KV buffers per worker (one registered array each).")
@click.option("--inflight", type=click.IntRange(min=1), default=8, show_default=True,
              help="Rooms the router keeps in flight.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the KV pools live.")
@click.option("--abort-rate", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Fraction of rooms aborted mid-way by the prefill side, the decode side "
                   "or out of band (Store.abort).")
@click.option("--kill-prefill-after", type=click.IntRange(min=0), metavar="N",
              help="SIGKILL one prefill worker after N rooms completed.")
@click.option("--lease", type=click.FloatRange(min=0.1), help="Engine lease in seconds "
              "[default: 2 with --kill-prefill-after, else 10].")
@click.option("--room-ttl", type=click.FloatRange(min=1.0), help="Room key TTL in seconds "
              "[default: 8 with --kill-prefill-after, else 60].")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Bootstrap, waiting and transfer timeouts of the workers' rooms.")
@click.option("--seed", type=int, help="Seed for rooms, lengths, workers and faults.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--listen", metavar="HOST:PORT", help="Serve the queues over TCP and wait for "
              "workers prefill-0.. and decode-0.. started with --worker/--router "
              "(docker-compose) instead of spawning them.")
@click.option("--worker", type=click.Choice(["prefill", "decode"]),
              help="Run one worker attached to a router started with --listen.")
@click.option("--engine", help="Engine id of this worker (with --worker), e.g. prefill-0.")
@click.option("--router", metavar="HOST:PORT", help="The router to attach to (with --worker).")
@click.pass_context
def demo(ctx: click.Context, url: str | None, namespace: str | None, n_requests: int,
         prefill_workers: int, decode_workers: int, pages_per_request: str, page_bytes: str,
         pool_pages: int, layers: int, inflight: int, device: str, abort_rate: float,
         kill_prefill_after: int | None, lease: float | None, room_ttl: float | None,
         timeout: float, seed: int | None, as_json: bool, listen: str | None,
         worker: str | None, engine: str | None, router: str | None) -> None:
    """Run a real disaggregated transfer end to end: Redis state, UCX bytes, every byte
    verified, every key gone. Exit 0 only if all of that held."""
    url, namespace = _inherit(ctx, url, namespace)
    if worker is not None:
        if not engine or not router:
            raise click.UsageError("--worker needs --engine and --router")
        with _errors(url):
            _run_attached(worker, engine, router, url, namespace)
        return
    lo, hi = _pages_range(pages_per_request)
    pb = _size(page_bytes)
    if hi > pool_pages:
        raise click.BadParameter(f"{hi} pages per request do not fit a pool of {pool_pages}",
                                 param_hint="--pages-per-request")
    if kill_prefill_after is not None and prefill_workers < 2:
        raise click.UsageError("--kill-prefill-after needs --prefill-workers 2 or more")
    killing = kill_prefill_after is not None
    lease = lease if lease is not None else (2.0 if killing else 10.0)
    room_ttl = room_ttl if room_ttl is not None else (8.0 if killing else 60.0)
    if device == "cuda":
        with _errors(url):
            _cuda_backend()
    opts = Options(n_requests, prefill_workers, decode_workers, lo, hi, inflight, abort_rate,
                   kill_prefill_after, seed, listen)
    with _errors(url):
        code = _run(opts, url, namespace or f"demo-{secrets.token_hex(3)}", pb, pool_pages,
                    layers, device, lease, room_ttl, timeout, as_json)
    ctx.exit(code)


def _inherit(ctx: click.Context, url: str | None,
             namespace: str | None) -> tuple[str | None, str | None]:
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


def _run_attached(role: str, engine: str, router: str, url: str | None,
                  namespace: str | None) -> None:
    inbox, outbox, cfg = _attach(router, engine)
    over = {k: v for k, v in (("url", url), ("namespace", namespace)) if v}
    cfg = WorkerConfig(**{**asdict(cfg), **over, "parent_pid": 0})
    WORKERS[role](cfg, engine, inbox, outbox)


def _run(opts: Options, url: str | None, namespace: str, page_bytes: int, pool_pages: int,
         layers: int, device: str, lease: float, room_ttl: float, timeout: float,
         as_json: bool) -> int:
    import kvstate
    from kvstate import embedded

    real_url = url or embedded.ensure_server()
    store = kvstate.connect(real_url, namespace, room_ttl)
    cfg = WorkerConfig(real_url, store.namespace, page_bytes, pool_pages, layers, device, lease,
                       room_ttl, timeout)
    err = _console(stderr=True)
    err.print(f"kvstate demo: Redis {store.url} namespace {store.namespace}; "
              f"{opts.prefill_workers} prefill + {opts.decode_workers} decode worker(s), "
              f"{opts.requests} requests")
    rtr = _Router(opts, cfg, store)
    counts: dict[str, int] = {}
    try:
        rtr.start()
        before = _command_counts(store)
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("rooms"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                      console=err, transient=as_json) as progress:
            task = progress.add_task("rooms", total=opts.requests, counts="")

            def tick(track: _Track) -> None:
                kind = track.outcome(rtr.killed)
                counts[kind] = counts.get(kind, 0) + 1
                progress.update(task, advance=1,
                                counts=" ".join(f"{k} {v}" for k, v in sorted(counts.items())))

            seconds = rtr.run(tick)
        rtr.stop()
    except BaseException:
        rtr.terminate()
        raise
    after = _command_counts(store)
    wait = room_ttl + lease + 5 if rtr.killed else lease + 2
    left, waited = _wait_for_no_keys(store, wait)
    audit = _audit(store)
    doc = _summary(opts, cfg, rtr, seconds, before, after, left, waited, audit)
    store.close()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_summary(doc)
    return 0 if doc["ok"] else EXIT_CHECK_FAILED


def _summary(opts: Options, cfg: WorkerConfig, rtr: _Router, seconds: float,
             before: dict[str, int], after: dict[str, int], left: list[str], waited: float,
             audit: dict[str, Any]) -> dict[str, Any]:
    rooms = []
    outcomes: dict[str, int] = {"done": 0, "failed": 0, "aborted": 0, "killed": 0, "corrupt": 0}
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
        rooms.append({
            "room": track.job.room, "outcome": kind, "pages": track.job.pages,
            "prefill": track.job.prefill, "decode": track.decode, "abort": track.abort,
            "verified": rx.verified if rx is not None else None,
            "bad_pages": rx.bad_pages if rx is not None else 0,
            "decode_status": rx.status if rx is not None else None,
            "decode_reason": rx.reason if rx is not None else "",
            "prefill_status": tx.status if tx is not None else
            ("killed" if track.prefill_dead else None),
            "prefill_reason": tx.reason if tx is not None else "",
        })
    injected = [t.abort for t in rtr.tracks.values() if t.abort]
    aborts = {"injected": len(injected), "landed": outcomes["aborted"],
              "by": {k: injected.count(k) for k in ABORT_KINDS}}
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k != "info"}
    by_command = dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -kv[1]))
    calls = sum(by_command.values())
    unexpected = outcomes["failed"] + outcomes["corrupt"]
    verified = all(r["verified"] for r in rooms if r["decode_status"] == "Success")
    ok = verified and not left and unexpected == 0
    return {
        "ok": ok,
        "requests": opts.requests,
        "outcomes": outcomes,
        "aborts": aborts,
        "all_success_verified": verified,
        "bytes_verified": nbytes,
        "seconds": round(seconds, 3),
        "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
        # bytes over the time prefill workers spent inside send(): the data plane plus
        # the two state transitions, without waiting, pattern filling or verifying
        "send_gb_per_s": round(nbytes / send_s / 1e9, 3) if send_s else 0.0,
        "write_gb_per_s": round(nbytes / write_s / 1e9, 3) if write_s else 0.0,
        "verify_s": round(verify_s, 3),
        "latency_ms": {"p50": round(_percentile(latencies, 50), 2),
                       "p99": round(_percentile(latencies, 99), 2),
                       "max": round(max(latencies, default=0.0), 2)},
        "redis": {
            "url": redact(cfg.url), "namespace": cfg.namespace,
            "commands": calls, "commands_per_room": round(calls / opts.requests, 1),
            "by_command": by_command,
        },
        "keys_left": len(left),
        "keys_left_sample": left[:10],
        "waited_for_keys_s": round(waited, 2),
        "audit": audit,
        "killed": rtr.killed,
        "workers": {"prefill": opts.prefill_workers, "decode": opts.decode_workers,
                    "transport": rtr.stats},
        "config": {"page_bytes": cfg.page_bytes, "pool_pages": cfg.pool_pages,
                   "layers": cfg.layers, "pages_per_request": [opts.pages_min, opts.pages_max],
                   "device": cfg.device, "lease_s": cfg.lease, "room_ttl_s": cfg.room_ttl,
                   "abort_rate": opts.abort_rate,
                   "kill_prefill_after": opts.kill_prefill_after, "seed": opts.seed},
        "rooms": rooms,
    }


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(stderr=stderr, width=width, highlight=False)


def _print_summary(doc: dict[str, Any]) -> None:
    from rich.table import Table

    o = doc["outcomes"]
    t = Table(title="kvstate demo", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("rooms", f"{doc['requests']}: done {o['done']}, failed {o['failed']}, "
              f"aborted {o['aborted']}, killed-peer {o['killed']}, corrupt {o['corrupt']}")
    a = doc["aborts"]
    if a["injected"]:
        by = ", ".join(f"{k} {v}" for k, v in a["by"].items())
        t.add_row("aborts", f"{a['injected']} injected ({by}); {a['landed']} landed, the rest "
                  "finished first")
    t.add_row("bytes verified", f"{doc['bytes_verified'] / 1e6:.1f} MB "
              f"({'all successful rooms match' if doc['all_success_verified'] else 'MISMATCH'})")
    t.add_row("throughput", f"{doc['gb_per_s']:.3f} GB/s end to end over "
              f"{doc['seconds']:.2f} s; inside send() {doc['send_gb_per_s']:.2f} GB/s, "
              f"of which UCX writes {doc['write_gb_per_s']:.2f} GB/s")
    lat = doc["latency_ms"]
    t.add_row("latency", f"p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms")
    r = doc["redis"]
    top = ", ".join(f"{k} {v / doc['requests']:.1f}" for k, v in
                    list(r["by_command"].items())[:4])
    t.add_row("redis commands/room", f"{r['commands_per_room']} ({top})")
    t.add_row("keys left", f"{doc['keys_left']}" + (
        f" after {doc['waited_for_keys_s']:.1f} s" if doc["waited_for_keys_s"] >= 0.5 else ""))
    t.add_row("audit", doc["audit"]["result"])
    if doc["killed"]:
        lost = [r for r in doc["rooms"] if r["outcome"] == "killed"]
        why = f"; e.g. {lost[0]['decode_reason']}" if lost else ""
        t.add_row("killed", f"{doc['killed']} (SIGKILL), {len(lost)} room(s) in flight{why}")
    t.add_row("result", "[green]OK[/green]" if doc["ok"] else "[red]FAILED[/red]")
    out = _console()
    out.print(t)
    for room in doc["rooms"]:
        if room["outcome"] in ("failed", "corrupt"):
            out.print(f"  room {room['room']}: {room['outcome']}: "
                      f"{room['decode_reason'] or room['prefill_reason']}")
    for key in doc["keys_left_sample"]:
        out.print(f"  key left: {key}")


if __name__ == "__main__":
    demo()
