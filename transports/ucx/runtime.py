"""The per-process UCX runtime: ucxx's context, worker and asyncio loop in one thread.

``ucxx``'s asyncio loop lives in one daemon thread per process, shared by
every ``UCXTransport`` in it; ctypes calls into libucp run on that thread,
which progresses the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from transports.base import TransportError
from transports.ucx.abi import LibUCP
from transports.ucx.settings import UCXSettings

_ARM_TRIES = 64  # progress calls per wake-up before the event loop gets a turn
_T = TypeVar("_T")


class Runtime:
    """ucxx's context, worker and asyncio loop, in one daemon thread per process."""

    _instance: Runtime | None = None
    _guard = threading.Lock()

    @classmethod
    def get(cls, settings: UCXSettings) -> Runtime:
        with cls._guard:
            if cls._instance is None:
                cls._instance = cls(settings)
            elif cls._instance.settings.progress_mode != settings.progress_mode:
                raise TransportError(
                    "UCX is already running in this process with progress mode "
                    f"{cls._instance.settings.progress_mode!r}"
                )
            return cls._instance

    def __init__(self, settings: UCXSettings) -> None:
        if settings.progress_mode not in ("blocking", "polling"):
            raise TransportError(
                f"progress mode {settings.progress_mode!r} not supported: use 'blocking' or "
                "'polling' (puts must be posted on the thread that progresses the worker)"
            )
        self.settings = settings
        self.ucx_env = settings.apply_env()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="kvstate-ucx", daemon=True)
        self.thread.start()
        try:
            self.call(self._init(), timeout=60.0, what="starting UCX")
        except Exception as exc:
            ucx = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
            raise TransportError(
                f"starting UCX failed: {exc}; check the UCX_* variables in effect: {ucx}"
            ) from exc

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> None:
        import ucxx  # heavy import, and UCX must see the environment set above

        # an option, not the environment: ucxx's import exports UCX_RNDV_THRESH=8192
        thresh = self.settings.rndv_thresh
        ucxx.init(
            options={"RNDV_THRESH": thresh} if thresh else {},
            progress_mode=self.settings.progress_mode,
        )
        self.ctx = ucxx.core._get_ctx()
        self.ucxx = ucxx
        self.context_h: int = self.ctx.context.handle
        self.worker = self.ctx.worker
        self.address: bytes = bytes(ucxx.get_worker_address())
        self.lib = LibUCP()
        if self.settings.progress_mode == "blocking":
            # ucxx 0.52's blocking mode progresses once per wake-up of the worker's epoll
            # fd but never re-arms the worker, so after the first event the fd stays
            # readable and the loop spins a core for good (measured: 55-97% CPU in idle
            # processes after one transfer). Start it now and take over its fd reader.
            self.ctx.continuous_ucx_progress(self.loop)
            fd = self.worker.epoll_file_descriptor
            self.loop.remove_reader(fd)
            self.loop.add_reader(fd, self._on_ucx_event)

    def _on_ucx_event(self) -> None:
        """Progress until UCX agrees to arm the worker (nothing left pending), so the fd
        only wakes the loop for new events; give the loop back after a bounded burst."""
        for _ in range(_ARM_TRIES):
            self.worker.progress()
            if self.worker.arm():
                return

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        """Run ``coro`` on the UCX thread and wait at most ``timeout`` seconds."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransportError(
                f"{what}: deadline of {timeout:.3g}s exceeded (UCX thread busy)"
            ) from None


def run_on_ucx_thread(coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
    """Run a ucxx coroutine on this process's UCX thread (for tools and benchmarks
    that drive ucxx directly next to a transport, with the same context and settings)."""
    return Runtime.get(UCXSettings()).call(coro, timeout, "ucxx call")
