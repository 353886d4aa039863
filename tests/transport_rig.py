"""The UCX transport test rig: peer processes that own a transport, and the checks of
what arrived (tests/test_transport.py, tests/test_transport_settings.py).

Each peer is a ``spawn``-ed process that owns a transport and obeys commands sent
through a pipe. Every timeout a test gives a peer (``call``, ``recv``, ``error_of``) is
stretched by ``$KVSTATE_TEST_TIME_FACTOR`` here (tests/helpers.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tests.helpers import scaled
from transports.base import Geometry, Target

# Three layers/kinds with different page sizes; same shape on every peer.
LAYOUT = [(96, 4096), (96, 1024), (96, 256)]  # (num_pages, page_bytes)
FILL = 0xEE


def sender_pages(layer: int, spec: list[tuple[int, int]] = LAYOUT, seed: int = 7) -> np.ndarray:
    """The sender's layer ``layer`` as (num_pages, page_bytes): random, reproducible."""
    pages, pb = spec[layer]
    rng = np.random.default_rng(seed * 1000 + layer)
    return rng.integers(0, 256, size=(pages, pb), dtype=np.uint8)


# ---------------------------------------------------------------------------
# The peer process.


def _peer_main(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    from transports.ucx import UCXTransport

    transport: Any = None
    bufs: list[np.ndarray] = []
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the test dropped this peer (e.g. after its registration failed)
            return
        try:
            if cmd == "register":
                spec, role, geometry, seed = args
                if role == "sender":
                    bufs = [
                        sender_pages(i, spec, seed).reshape(-1).copy() for i in range(len(spec))
                    ]
                else:
                    bufs = [np.full(n * pb, FILL, dtype=np.uint8) for n, pb in spec]
                transport = UCXTransport()
                transport.register_buffers(bufs, [pb for _, pb in spec], geometry)
                conn.send(("ok", (transport.endpoint(), transport.layout())))
            elif cmd == "refill":
                for b in bufs:
                    b.fill(FILL)
                conn.send(("ok", None))
            elif cmd == "ucx_env":
                conn.send(("ok", transport.ucx_env()))
            elif cmd == "dump":
                conn.send(("ok", [b.tobytes() for b in bufs]))
            elif cmd == "expect":
                transport.expect(*args)
                conn.send(("ok", None))
            elif cmd == "release":
                transport.release(*args)
                conn.send(("ok", None))
            elif cmd == "write":
                room, src, targets, timeout = args
                t0 = time.monotonic()
                transport.write(room, src, targets, timeout)
                conn.send(("ok", (time.monotonic() - t0, transport.stats)))
            elif cmd == "writes":
                # Several writes in turn from one message: targets sent together share
                # their layout objects here, as a receiver's registration read once does.
                for job in args[0]:
                    transport.write(*job)
                conn.send(("ok", transport.stats))
            elif cmd == "write_many":
                jobs, timeout = args
                conn.send(("ok", transport.write_many(jobs, timeout)))
            elif cmd == "write_threads":
                # Several writes at once from caller threads, as a serving engine does.
                import threading

                errors: list[str] = []
                threads = [
                    threading.Thread(target=_write_reporting, args=(transport, job, errors))
                    for job in args[0]
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                conn.send(("ok", errors))
            elif cmd == "write_loop":
                # Write until something fails; report when and why (for kill tests).
                room, src, targets, timeout = args
                transport.write(room, src, targets, timeout)
                conn.send(("started", None))
                while True:
                    transport.write(room, src, targets, timeout)
            elif cmd == "close":
                transport.close()
                transport.close()  # idempotent
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", "ValueError", f"unknown command {cmd}", time.monotonic()))
        except Exception as exc:  # reported to the test, which decides
            conn.send(("error", type(exc).__name__, str(exc), time.monotonic()))


def _write_reporting(transport: Any, job: tuple[Any, ...], errors: list[str]) -> None:
    try:
        transport.write(*job)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


class Peer:
    """Handle on a peer process."""

    def __init__(
        self,
        role: str,
        spec: list[tuple[int, int]] = LAYOUT,
        env: dict[str, str] | None = None,
        geometry: list[Geometry] | None = None,
        seed: int = 7,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, env or {}), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self.endpoint, self.layout = self.call("register", spec, role, geometry, seed)

    def call(self, *msg: Any, timeout: float = 30.0) -> Any:
        self.conn.send(msg)
        reply = self.recv(timeout)
        if reply[0] == "error":
            raise AssertionError(f"peer raised {reply[1]}: {reply[2]}")
        return reply[1]

    def recv(self, timeout: float) -> Any:
        """The peer's next reply, within ``scaled(timeout)``."""
        if not self.conn.poll(scaled(timeout)):
            raise AssertionError(f"peer did not answer within {scaled(timeout):g}s")
        return self.conn.recv()

    def error_of(self, *msg: Any, timeout: float = 30.0) -> tuple[str, str]:
        """Send a command that must fail; return (exception type name, message)."""
        self.conn.send(msg)
        reply = self.recv(timeout)
        assert reply[0] == "error", f"expected an error, got {reply!r}"
        return reply[1], reply[2]

    def target(self, dst: Any, **kw: Any) -> Target:
        return Target(self.endpoint, self.layout, np.asarray(dst, dtype=np.int32), **kw)

    def layers(self) -> list[np.ndarray]:
        return [
            np.frombuffer(b, dtype=np.uint8).reshape(n, pb)
            for b, (n, pb) in zip(self.call("dump"), self.spec, strict=True)
        ]

    def memory(self) -> list[np.ndarray]:
        """Its layers read from outside (``/proc/<pid>/mem``), which works while the
        peer is stopped: what a stalled receiver holds, not what it would answer."""
        out = []
        with open(f"/proc/{self.proc.pid}/mem", "rb", buffering=0) as mem:
            for buf, (n, pb) in zip(self.layout["buffers"], self.spec, strict=True):
                mem.seek(buf["addr"])
                out.append(np.frombuffer(mem.read(buf["nbytes"]), dtype=np.uint8).reshape(n, pb))
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid or 0, signal.SIGKILL)
        self.proc.join(scaled(10))

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(AssertionError, OSError, EOFError):
                self.call("close", timeout=10)
        self.proc.join(scaled(5))
        self.kill()


def expected_layers(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Receiver contents after writing, for each (src, dst), sender pages src to dst."""
    out = []
    for layer, (n, pb) in enumerate(LAYOUT):
        want = np.full((n, pb), FILL, dtype=np.uint8)
        for src, dst in pairs:
            want[dst] = sender_pages(layer)[src]
        out.append(want)
    return out


def assert_layers(rx: Peer, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for layer, (got, want) in enumerate(zip(rx.layers(), expected_layers(pairs), strict=True)):
        bad = np.flatnonzero((got != want).any(axis=1))
        assert bad.size == 0, f"layer {layer}: pages {bad[:10].tolist()} differ"


def fragmented(rng: np.random.Generator, n: int, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pages in runs of 1-8, placed at random (and differently) on both sides."""
    lens: list[int] = []
    while sum(lens) < n:
        lens.append(int(min(rng.integers(1, 9), n - sum(lens))))

    def place() -> np.ndarray:
        # Runs in a random order, separated by random gaps, never overlapping.
        gaps = np.diff(np.concatenate(([0], np.sort(rng.integers(0, pages - n + 1, len(lens))))))
        starts, pos = {}, 0
        for k, gap in zip(rng.permutation(len(lens)), gaps, strict=True):
            pos += int(gap)
            starts[int(k)] = pos
            pos += lens[k]
        return np.concatenate(
            [np.arange(starts[k], starts[k] + lens[k]) for k in range(len(lens))]
        ).astype(np.int32)

    return place(), place()
