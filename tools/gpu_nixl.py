"""NIXL's side of ``tools/gpu_check.py --nixl``: the same pages, device arrays and checks
as kvstate's run, moved by NIXL 1.5 (UCX backend, WRITE, error handling on as its
default), so the two compare on one host (cuda_ipc between GPUs of one node; host
memory with ``--host-dry-run``). Spawned processes: module-level functions."""

from __future__ import annotations

import os
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from transports.pages import merge_runs


def available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


def _agent(name: str, error_handling: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
    return agent


def _mem(dev: Any) -> str:
    return "DRAM" if dev.kind == "numpy" else "VRAM"


def receiver(
    conn: Connection, gpu: str, layers: int, nbytes: int, dry: bool, error_handling: str
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        from tools.gpu_arrays import Device, digests

        dev = Device(dry)
        bufs = [dev.zeros(nbytes) for _ in range(layers)]
        dev.sync()
        agent = _agent("rx", error_handling)
        agent.register_memory([(dev.ptr(b), nbytes, 0, "") for b in bufs], _mem(dev))
        conn.send(("ok", (agent.get_agent_metadata(), [dev.ptr(b) for b in bufs])))
        while True:
            cmd = conn.recv()
            if cmd == "digest":
                dev.sync()
                conn.send(("ok", digests(dev, bufs)))
            elif cmd == "zero":
                dev.zero(bufs)
                conn.send(("ok", None))
            else:
                conn.send(("ok", None))
                return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def sender(
    conn: Connection,
    gpu: str,
    layers: int,
    nbytes: int,
    page_bytes: int,
    peer: tuple[bytes, list[int]],
    rx: Connection,
    reps: int,
    dry: bool,
    error_handling: str,
) -> None:
    """Per layout: the transfer prepared once and re-posted (NIXL's best case), timed
    ``reps`` times after one warm-up, then the receiver's bytes checked."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        from tools.gpu_arrays import Device, expected, fragmented, host_layer

        dev = Device(dry)
        bufs = [dev.upload(host_layer(i, nbytes)) for i in range(layers)]
        dev.sync()
        agent = _agent("tx", error_handling)
        mem = _mem(dev)
        agent.register_memory([(dev.ptr(b), nbytes, 0, "") for b in bufs], mem)
        remote = agent.add_remote_agent(peer[0])
        pages = nbytes // page_bytes
        ident = np.arange(pages, dtype=np.int32)
        out: dict[str, Any] = {}
        for name, (src, dst) in (("contiguous", (ident, ident)), ("fragmented", fragmented(pages))):
            rx.send("zero")
            rx.recv()
            runs = merge_runs(src, dst)
            n = runs.length * page_bytes
            local = np.concatenate(
                [np.stack([dev.ptr(b) + runs.src * page_bytes, n, 0 * n], 1) for b in bufs]
            ).astype(np.uint64)
            far = np.concatenate(
                [np.stack([a + runs.dst * page_bytes, n, 0 * n], 1) for a in peer[1]]
            ).astype(np.uint64)
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, mem),
                agent.get_xfer_descs(far, mem),
                remote,
                b"",
            )

            from tools.bench.transfer.drivers import nixl_write

            def xfer(h: Any = h) -> None:
                nixl_write(agent, h)

            xfer()  # warm-up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                xfer()
                times.append(time.perf_counter() - t0)
            rx.send("digest")
            _, got = rx.recv()
            want = expected(layers, nbytes, page_bytes, src, dst)
            out[name] = {"median_s": statistics.median(times), "verified": got == want}
            agent.release_xfer_handle(h)
        conn.send(("ok", (dev.kind, out)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
