"""A rank's call run behind its scheduler step: on a thread of the rank's own, so the
step goes on while Redis answers and pages move (``KVManager.run_behind``: the vLLM
worker's whole step; ``finish_many(wait=False)``, ``clear_many(wait=False)``: one
batch). Calls stay in order: the rank's next call, from any thread, first waits for the
one behind (it is bounded by its own deadline), so the rank's participants are never
touched by two calls at once; a ``wait=False`` call made by the call behind runs at once.

The thread takes the GIL when the caller next lets go of it (or after the interpreter's
5 ms switch interval): a vLLM worker lets go while it waits for its device, and blocks
between steps. Handing it over at once (a sleep(0) after submitting) sent the finish
0.1-0.3 ms sooner but cost the push step 0.35 ms of waiting for the GIL back
(tools/bench/steps' engine): not done.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

_T = TypeVar("_T")
# the name of a rank's thread behind starts so (RoundTrips.by_thread tells its trips apart)
THREAD_PREFIX = "kvstate-behind-"


class Behind:
    """At most one call of a rank running behind its step."""

    def __init__(self, engine: str) -> None:
        self.name = THREAD_PREFIX + engine
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._running: Future[Any] | None = None
        self._here = threading.local()  # set on the thread while it runs the call
        self.spent = 0.0  # seconds the calls behind ran, all told (benchmarks read it)

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` behind, once the call before it ended; at once when this is the
        call behind (a step run behind that makes a ``wait=False`` call)."""
        if getattr(self._here, "on", False):
            now: Future[_T] = Future()
            try:
                now.set_result(fn())
            except BaseException as exc:  # as the pool's Future keeps it
                now.set_exception(exc)
            return now
        self.settle()
        if self._pool is None or self._pid != os.getpid():  # none yet, or a fork's
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            self._pid = os.getpid()
        ctx = contextvars.copy_context()
        running = self._pool.submit(ctx.run, self._run, fn)
        self._running = running
        return running

    def _run(self, fn: Callable[[], _T]) -> _T:
        self._here.on = True
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.spent += time.perf_counter() - t0
            self._here.on = False

    def settle(self) -> None:
        """Wait for the call behind to end (its outcome stays its future's), unless this
        is that call."""
        running = self._running
        if running is None or getattr(self._here, "on", False):
            return
        wait([running])
        if self._running is running:
            self._running = None

    def close(self) -> None:
        self.settle()
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None


__all__ = ["THREAD_PREFIX", "Behind"]
