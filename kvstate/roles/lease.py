"""An engine rank's registration and its lease, kept by a heartbeat thread on a store
of its own (a workload holding every connection of the shared pool, or a server at
maxclients, cannot make the lease lapse). One owner per engine name: a name taken by
another process after this one's lease lapsed is never taken back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstate.errors import KVStateError
from kvstate.registry import Claim, EngineInfo, Registry
from kvstate.store import Store

log = logging.getLogger(__name__)


class Lease:
    """Registers ``info`` (``EngineNameTakenError`` when a live process holds the name)
    and renews it every ``interval``; after each renewal ``on_beat`` runs (the peer
    watch) and, once, if another process took the name, ``on_taken``; both are given
    the lease's own registry or store."""

    def __init__(
        self,
        store: Store,
        info: EngineInfo,
        lease: float,
        interval: float,
        on_beat: Callable[[Registry], None],
        on_taken: Callable[[Claim, Store], None],
    ) -> None:
        self.info = info
        self.lease = lease
        self.interval = interval
        self._on_beat = on_beat
        self._on_taken = on_taken
        self.taken: Claim | None = None  # who holds our name since our lease lapsed
        # monotonic time until which the lease is surely ours: the start of the last
        # register/renew Redis confirmed, plus the lease (a finish after it fails)
        self._until = 0.0
        with store.bounded():  # making it (a Cluster's slot map) and registering: one call
            self.store = store.dedicated()
            self.registry = Registry(self.store)
            try:
                started = time.monotonic()
                self.registry.register(info, lease)
                self._until = started + lease
            except BaseException:
                self.store.close()
                raise
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvstate-{info.engine}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        """The heartbeat thread is alive (it stops at close() or when the name is taken)."""
        return self._thread.is_alive()

    def lapsed(self) -> str:
        """Why this engine may have lost its lease ('' while it surely holds it): no
        renewal confirmed within a lease (the process was stopped or cut off from
        Redis), or another process took the name. Its peers may have failed its rooms
        meanwhile, so it must not write Success (design rule 3)."""
        engine = self.info.engine
        if self.taken is not None:
            return f"engine {engine}'s lease was taken by another process"
        started = time.monotonic()
        late = started - self._until
        if late <= 0:
            return ""
        # No renewal confirmed within a lease (a starved heartbeat, or a stop): ask Redis
        # whether the registration outlived it, one round trip in this rare case only.
        try:
            claim = self.registry.renew(self.info, self.lease)
        except KVStateError as exc:
            claim = None
            log.warning("lease check of %s: %s", engine, exc)
        if claim is not None and claim.answer == "renewed":  # it never lapsed
            self._until = started + self.lease
            return ""
        return (
            f"engine {engine} lost its lease ({self.lease:g} s): no renewal confirmed "
            f"for {late + self.lease:.1f} s (stopped, or cut off from Redis), and Redis "
            f"answered {claim.answer if claim else 'nothing'}; its peers may have failed "
            "the room, so it cannot succeed"
        )

    def _run(self) -> None:
        engine = self.info.engine
        while not self._stop.wait(self.interval):
            try:
                started = time.monotonic()
                claim = self.registry.renew(self.info, self.lease)
                if claim.answer == "taken":
                    self.taken = claim
                    self._stop.set()
                    self._on_taken(claim, self.store)
                    return
                self._until = started + self.lease
                if claim.answer == "lapsed":
                    log.warning("lease of %s had lapsed; registered again", engine)
                self._on_beat(self.registry)
            except KVStateError as exc:
                log.warning("heartbeat of %s: %s", engine, exc)
            except Exception as exc:  # the lease must outlive any surprise; never die
                log.warning("heartbeat of %s: unexpected %s: %s", engine, type(exc).__name__, exc)

    def stop(self) -> None:
        """Stop renewing, as a stopped process would (the registration stays until it
        expires or is dropped): its peers fail its rooms once the lease lapses."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def close(self, before_drop: Callable[[], None] = lambda: None) -> None:
        """Stop the heartbeat, run ``before_drop`` and drop the registration (if it is
        still ours), all within one call_timeout; then close the store."""
        self._stop.set()
        try:
            with self.store.bounded():
                if self._thread is not threading.current_thread():
                    self._thread.join(timeout=5)
                before_drop()
                if self.taken is None:
                    self.registry.drop(self.info.engine, self.info.incarnation, self.info.addr)
        except KVStateError as exc:
            log.warning("could not drop the registration of %s: %s", self.info.engine, exc)
        finally:
            self.store.close()


__all__ = ["Lease"]
