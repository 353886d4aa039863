"""The router: the parent process. It spawns the workers (or waits for them to attach),
hands each room to a prefill and a decode worker, injects faults and collects results.
It never reads or writes room state except to inject an out-of-band abort.

Fault injection: ``--abort-rate`` aborts rooms mid-way (from the prefill side, the
decode side, or out of band with ``Store.abort``); ``--kill-prefill-after`` SIGKILLs a
prefill worker and expects its in-flight rooms to fail, with a reason naming the peer,
through the decode side's lease watcher."""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue as SpawnQueue
from typing import Any

import click

from kvstate.demo.engines import WORKERS
from kvstate.demo.messages import (
    Abort,
    Bye,
    Die,
    Job,
    Ready,
    Release,
    Result,
    Stop,
    ToRouter,
    WorkerConfig,
    WorkerFailed,
)
from kvstate.demo.outcome import ABORT_KINDS, Track
from kvstate.demo.queues import Inbox, PipeOut, RemoteQueues
from kvstate.errors import KVStateError
from kvstate.ops import reads
from kvstate.store import Store

__all__ = ["Interrupted", "Options", "Router", "Signals"]


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


class Interrupted(Exception):
    """Raised in the router's loops once SIGINT or SIGTERM arrived."""


class Signals:
    """SIGINT (Ctrl-C) and SIGTERM (``docker stop``) in the router: the first one asks
    for an orderly stop (workers clear their rooms in flight, a partial summary is
    printed, the exit status is 128 + the signal); a second one, or any one once the
    rooms are over (``urgent``: the checks after the run), stops waiting: it raises
    KeyboardInterrupt where the router waits, and ``last`` says which signal it was."""

    def __init__(self) -> None:
        self.got = 0
        self.last = 0
        self.urgent = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame: Any) -> None:
        again = bool(self.got)
        self.got = self.got or signum
        self.last = signum
        if again or self.urgent:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Router:
    """Starts the workers, hands out rooms, injects faults and collects results."""

    def __init__(
        self, opts: Options, cfg: WorkerConfig, store: Store, signals: Signals | None = None
    ) -> None:
        self.opts, self.cfg, self.store = opts, cfg, store
        self.signals = signals or Signals()
        self.interrupted = 0  # the signal that stopped the run
        self.hosts: dict[str, str] = {}
        self.rng = random.Random(opts.seed)
        self.prefills = [f"prefill-{i}" for i in range(opts.prefill_workers)]
        self.decodes = [f"decode-{i}" for i in range(opts.decode_workers)]
        self.procs: dict[str, BaseProcess] = {}
        self.pids: dict[str, int] = {}
        self.inboxes: dict[str, Inbox] = {}
        self.readers: dict[Connection, str] = {}  # one pipe per worker -> its engine
        self.buffer: deque[ToRouter] = deque()
        self.addrs: dict[str, str] = {}
        self.remote: RemoteQueues | None = None
        self.tracks: dict[int, Track] = {}
        self.pending_oob: list[int] = []
        self.alive_prefills = list(self.prefills)
        self.killed: str | None = None
        self.stats: dict[str, dict[str, Any]] = {}
        self.finished = 0

    # -- workers ---------------------------------------------------------------
    def start(self) -> None:
        if self.opts.listen:
            self.remote = RemoteQueues(self.opts.listen, self.cfg)
            click.echo(
                f"kvstate demo: waiting for workers {', '.join(self.prefills)}, "
                f"{', '.join(self.decodes)} (kvstate demo --worker ROLE --engine NAME "
                f"--router {self.opts.listen})",
                err=True,
            )
            for engine in self.prefills + self.decodes:
                self.inboxes[engine] = self.remote.inbox(engine)
        else:
            self._spawn()
        wanted = set(self.prefills + self.decodes)
        deadline = time.monotonic() + (600 if self.opts.listen else 120)
        while wanted - set(self.addrs):
            msg = self._get(deadline)
            if isinstance(msg, Ready):
                self.addrs[msg.engine], self.pids[msg.engine] = msg.addr, msg.pid
                self.hosts[msg.engine] = msg.host

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        cfg = WorkerConfig(**{**asdict(self.cfg), "parent_pid": os.getpid()})
        # Children start with SIGINT ignored (inherited through exec) so a Ctrl-C during
        # their imports cannot print a traceback; they keep it ignored (see workers.serve).
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
                args=(cfg, engine, self.inboxes[engine], PipeOut(writer)),
                daemon=True,
            )
            proc.start()
            writer.close()
            self.procs[engine] = proc
            self.readers[reader] = engine
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def _next(self) -> ToRouter | None:
        """The next message from any worker, or None after a short wait."""
        if self.remote is not None:
            try:
                return self.remote.outbox.get(timeout=0.05)
            except queue.Empty:
                return None
        if not self.buffer:
            for conn in wait(list(self.readers), timeout=0.05):
                assert isinstance(conn, Connection)
                try:
                    self.buffer.append(conn.recv())
                except (EOFError, OSError):  # exited; the liveness check says how
                    del self.readers[conn]
        return self.buffer.popleft() if self.buffer else None

    def _get(self, deadline: float, interruptible: bool = True) -> ToRouter:
        while True:
            if interruptible and self.signals.got:
                self.interrupted = self.signals.got
                raise Interrupted
            msg = self._next()
            if isinstance(msg, WorkerFailed):
                raise KVStateError(f"worker {msg.engine} failed:\n{msg.traceback}")
            if msg is not None:
                return msg
            for engine, proc in self.procs.items():
                if engine != self.killed and not proc.is_alive():
                    raise KVStateError(f"worker {engine} exited with status {proc.exitcode}")
            if time.monotonic() > deadline:
                raise KVStateError("timed out waiting for the workers (see their output above)")

    def stop(self) -> None:
        """Let every worker finish (or, once interrupted, clear its rooms in flight) and
        say goodbye with its transport stats; results that arrive meanwhile still count."""
        for engine, inbox in self.inboxes.items():
            if engine != self.killed:
                inbox.put(Abort() if self.interrupted else Stop())
        deadline = time.monotonic() + (20 if self.interrupted else 60)
        expected = self._saying_bye()
        while expected - set(self.stats):
            try:
                msg = self._get(deadline, interruptible=False)
            except KVStateError:
                if not self.interrupted:
                    raise
                break  # a worker that died or did not answer: terminate() ends it
            if isinstance(msg, Bye):
                self.stats[msg.engine] = msg.stats
            elif isinstance(msg, Result) and msg.room in self.tracks:
                self.tracks[msg.room].results[msg.role] = msg
        for proc in self.procs.values():
            proc.join(30)
        for inbox in self.inboxes.values():
            if isinstance(inbox, SpawnQueue):  # free its semaphores now
                inbox.close()
                inbox.join_thread()

    def _saying_bye(self) -> set[str]:
        """The workers a Bye is awaited from: all but the killed one; once interrupted,
        only those that exist (the run may stop before every worker attached)."""
        return {
            e
            for e in self.inboxes
            if e != self.killed and (not self.interrupted or e in self.addrs or e in self.procs)
        }

    def terminate(self) -> None:
        """On error or Ctrl-C: no worker outlives the router."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    # -- rooms ---------------------------------------------------------------------
    def run(self, tick: Callable[[Track], None]) -> float:
        """Push every request through; returns the seconds it took."""
        started = time.monotonic()
        backstop = self.cfg.timeout * 3 + self.cfg.lease * 3 + 30
        todo = self.opts.requests
        live: dict[int, Track] = {}
        while todo or live:
            while todo and len(live) < self.opts.inflight:
                track = self._dispatch()
                live[track.job.room] = track
                todo -= 1
            self._maybe_kill(live, tick)
            self._fire_oob_aborts(live)
            try:
                msg = self._get(time.monotonic() + backstop)
            except Interrupted:
                break
            except KVStateError as exc:
                if "timed out" in str(exc):
                    raise KVStateError(
                        f"{len(live)} room(s) got no result in {backstop:.0f} s: {sorted(live)[:5]}"
                    ) from None
                raise
            if not isinstance(msg, Result):
                continue
            track = live.get(msg.room) or self.tracks[msg.room]
            track.results[msg.role] = msg
            self._after_result(track, live, tick)
        return time.monotonic() - started

    def _dispatch(self) -> Track:
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
        track = Track(job, decode, time.monotonic(), abort)
        self.tracks[room] = track
        if abort == "router":
            self.pending_oob.append(room)
        self.inboxes[prefill].put(job)
        self.inboxes[decode].put(job)
        return track

    def _fire_oob_aborts(self, live: dict[int, Track]) -> None:
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
                        self.store.execute([reads.unmark(self.store.keys, room)])
                    continue
                except KVStateError:  # the room kept changing: try again next tick
                    pass
            keep.append(room)
        self.pending_oob = keep

    def _after_result(
        self, track: Track, live: dict[int, Track], tick: Callable[[Track], None]
    ) -> None:
        rx = track.results.get("decode")
        failed = rx is not None and rx.status == "Failed"
        tx_done = "prefill" in track.results or track.prefill_dead
        if failed and tx_done:  # the sender can no longer write into those pages
            self.inboxes[track.decode].put(Release(track.job.room))
        if track.complete and track.job.room in live:
            track.done_at = time.monotonic()
            del live[track.job.room]
            self.finished += 1
            tick(track)

    def _maybe_kill(self, live: dict[int, Track], tick: Callable[[Track], None]) -> None:
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
        if victim in self.procs:
            self._kill_child(victim)
        else:  # a remote worker: it kills itself
            self.inboxes[victim].put(Die())
            time.sleep(1)
        for track in list(live.values()):
            if track.job.prefill == victim:
                track.prefill_dead = True
                self._after_result(track, live, tick)

    def _kill_child(self, victim: str) -> None:
        """SIGKILL a spawned worker, keeping the results it sent before it died."""
        proc = self.procs[victim]
        conn = next(c for c, e in self.readers.items() if e == victim)
        while conn.poll():  # whole messages already sent are still results
            self.buffer.append(conn.recv())
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        # A write cut short by the kill would block a read forever: stop reading it.
        del self.readers[conn]
        inbox = self.inboxes[victim]
        if isinstance(inbox, SpawnQueue):
            inbox.cancel_join_thread()
