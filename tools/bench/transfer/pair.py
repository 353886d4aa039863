"""A system's receiver and sender processes, started once and driven one rep at a time."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from tools.bench.transfer.rx import rx_main
from tools.bench.transfer.sites import Site
from tools.bench.transfer.systems import System
from tools.bench.transfer.tx import tx_main
from tools.bench.transfer.workload import Config


class Pair:
    """A system's receiver and sender processes, driven one rep at a time."""

    def __init__(self, system: System, cfg: Config, site: Site, layouts: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.system = system
        self.rx, rx_end = ctx.Pipe()
        self.procs = [
            ctx.Process(target=rx_main, args=(system, cfg, site, layouts, rx_end), daemon=True)
        ]
        self.procs[0].start()
        try:
            info = self._reply(self.rx, 120, "receiver did not start")
            self.tx, tx_end = ctx.Pipe()
            self.procs.append(
                ctx.Process(
                    target=tx_main,
                    args=(system, cfg, site, info, layouts, tx_end, self.rx),
                    daemon=True,
                )
            )
            self.procs[1].start()
            self.cases: list[str] = self._reply(self.tx, 120, "sender did not start")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _reply(conn: Connection, timeout: float, what: str) -> Any:
        if not conn.poll(timeout):
            raise RuntimeError(f"{what} within {timeout:.0f} s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def pause(self, stop: bool) -> None:
        """SIGSTOP / SIGCONT both processes: an idle pair must not take CPU from the one
        being timed (NIXL's idle processes spin a core each here)."""
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def call(self, cmd: str, timeout: float = 300) -> Any:
        self.tx.send(cmd)
        return self._reply(self.tx, timeout, f"sender did not answer {cmd!r}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pause(False)
            if len(self.procs) > 1:
                self.call("stop", 10)
            self.rx.send(("stop",))
            self.rx.poll(10)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
