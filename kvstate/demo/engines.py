"""What each engine does in the worker loop: a prefill engine 'computes' the KV and
sends it; a decode engine publishes its pages, verifies every byte it received and keeps
the pages of a failed room until the sender can no longer write into them.

The entry points are module-level functions so the ``spawn`` start method can import
them."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvstate.demo.messages import WorkerConfig
from kvstate.demo.queues import Inbox, Outbox
from kvstate.demo.workers import Room, Worker, serve
from kvstate.errors import KVStateError
from kvstate.poll import KVPoll
from kvstate.roles import KVReceiver, KVSender

__all__ = ["WORKERS", "decode_worker", "prefill_worker"]


class _Prefill(Worker[KVSender]):
    """Creates a sender per job; once the receiver published its pages, 'computes' the
    KV (writes the pattern into source pages), sends and clears."""

    role = "prefill"

    def _start_waiting(self) -> None:
        while self.waiting:
            job = self.waiting.popleft()
            snd = self.mgr.sender(job.room, required_receivers=1)
            snd.init(job.pages)
            self.active[job.room] = Room(job, snd)

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

    def _holding(self, room: Room[KVSender]) -> bool:
        """--hold: keep the room in WaitingForInput (both sides published, nothing moved)
        for that long, so ``kvstate show`` / ``ls`` can catch it."""
        if room.ready_at is None:
            room.ready_at = time.monotonic()
        return time.monotonic() - room.ready_at < self.cfg.hold

    def _send(self, room: Room[KVSender]) -> None:
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


class _Decode(Worker[KVReceiver]):
    """Allocates destination pages per job, publishes them, waits for Success, verifies
    every byte, clears. Pages of a failed room stay out of the free list until the router
    says the sender can no longer write into them (a one-sided put cannot be refused)."""

    role = "decode"

    def __init__(self, cfg: WorkerConfig, engine: str, inbox: Inbox, outbox: Outbox) -> None:
        super().__init__(cfg, engine, inbox, outbox)
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
            room = Room(job, rcv, pages)
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

    def _sender_joined(self, room: Room[KVReceiver]) -> bool:
        """Abort only once the sender exists, so the abort reaches both sides."""
        return any(m.startswith("tx:") for m in self.store.members(room.job.room))

    def _verify(self, room: Room[KVReceiver]) -> None:
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

    def _settle_failed(self, room: Room[KVReceiver]) -> None:
        if room.pages is not None:
            self.quarantine[room.job.room] = room.pages

    def _release(self, room: int) -> None:
        pages = self.quarantine.pop(room, None)
        if pages is not None:
            self.pool.release(pages)


def prefill_worker(cfg: WorkerConfig, engine: str, inbox: Inbox, outbox: Outbox) -> int:
    """Entry point of a prefill worker process (importable for ``spawn``)."""
    return serve(_Prefill, cfg, engine, inbox, outbox)


def decode_worker(cfg: WorkerConfig, engine: str, inbox: Inbox, outbox: Outbox) -> int:
    """Entry point of a decode worker process (importable for ``spawn``)."""
    return serve(_Decode, cfg, engine, inbox, outbox)


WORKERS: dict[str, Callable[[WorkerConfig, str, Inbox, Outbox], int]] = {
    "prefill": prefill_worker,
    "decode": decode_worker,
}
