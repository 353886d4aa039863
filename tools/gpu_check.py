#!/usr/bin/env python3
"""GPU check for a machine with an NVIDIA GPU: device KV pages through UCXTransport.

Run on the GPU machine (one short script, a few seconds):

    python tools/gpu_check.py [--layers 4] [--pages 1024] [--page-kib 16] [--proto-info]

1. Prints NVML facts (driver, each GPU's name, UUID, PCI bus id, memory, NVLink
   links, topology between GPUs) from ``pynvml`` (package nvidia-ml-py).
2. Spawns a receiver and a sender process, each holding device arrays (cupy,
   else torch), registered with ``UCXTransport`` without host copies; with two
   or more GPUs the receiver uses GPU 1 and the sender GPU 0.
3. Writes all pages contiguously, then fragmented (runs of 1-8 pages at random
   places); the receiver copies its arrays to the host once and checks every
   byte against what the sender's pages predict.
4. Prints GB/s of each against an in-process device-to-device copy.

``--host-dry-run`` runs the same processes on numpy arrays through the same
UCX put path (no GPU needed) to check the script itself.

Exit status: 0 all bytes verified; 1 a mismatch or a transfer error; 2 no GPU
(or neither cupy nor torch with CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

NO_GPU = 2


def nvml_facts() -> tuple[int, list[str]]:
    """(GPU count, printable lines); count 0 when NVML or a driver is missing."""
    try:
        import pynvml
    except ImportError:
        return 0, ["pynvml (nvidia-ml-py) is not installed"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, [f"NVML unavailable: {exc}"]
    lines = []
    try:

        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        count = pynvml.nvmlDeviceGetCount()
        lines.append(
            f"driver {text(pynvml.nvmlSystemGetDriverVersion())}, "
            f"CUDA driver API {pynvml.nvmlSystemGetCudaDriverVersion()}, {count} GPU(s)"
        )
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            links = []
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link):
                        links.append(link)
                except pynvml.NVMLError:
                    break
            lines.append(
                f"GPU {i}: {text(pynvml.nvmlDeviceGetName(h))}, "
                f"{text(pynvml.nvmlDeviceGetUUID(h))}, PCI {text(pci.busId)}, "
                f"{mem.total / 2**30:.1f} GiB "
                f"({mem.used / 2**30:.1f} used), NVLink links up: {len(links)}"
            )
        for i in range(count):
            for j in range(i + 1, count):
                try:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    lines.append(f"topology GPU {i} <-> GPU {j}: level {level}")
                except pynvml.NVMLError as exc:
                    lines.append(f"topology GPU {i} <-> GPU {j}: {exc}")
        return count, lines
    finally:
        pynvml.nvmlShutdown()


class Device:
    """cupy or torch, whichever imports with CUDA: allocate, upload, download, copy."""

    def __init__(self, host: bool = False) -> None:
        self.kind = ""
        if host:  # --host-dry-run: numpy arrays, to check this script's plumbing anywhere
            self.kind = "numpy"
            return
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
            self.cp: Any = cupy
            self.kind = "cupy"
            return
        except Exception:
            pass
        try:
            import torch

            if torch.cuda.is_available():
                self.torch: Any = torch
                self.kind = "torch"
        except Exception:
            pass

    def upload(self, host: np.ndarray) -> Any:
        if self.kind == "numpy":
            return host.copy()
        if self.kind == "cupy":
            return self.cp.asarray(host)
        return self.torch.from_numpy(host).to("cuda")

    def zeros(self, nbytes: int) -> Any:
        if self.kind == "numpy":
            return np.zeros(nbytes, dtype=np.uint8)
        if self.kind == "cupy":
            return self.cp.zeros(nbytes, dtype=self.cp.uint8)
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")

    def download(self, arr: Any) -> np.ndarray:
        if self.kind == "numpy":
            return np.asarray(arr)
        if self.kind == "cupy":
            return self.cp.asnumpy(arr)
        return arr.cpu().numpy()

    def sync(self) -> None:
        if self.kind == "numpy":
            return
        if self.kind == "cupy":
            self.cp.cuda.runtime.deviceSynchronize()
        else:
            self.torch.cuda.synchronize()

    def copy(self, dst: Any, src: Any) -> None:
        if self.kind == "numpy":
            np.copyto(dst, src)
        elif self.kind == "cupy":
            dst[...] = src
        else:
            dst.copy_(src)


def host_layer(layer: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(99 + layer).integers(0, 256, size=nbytes, dtype=np.uint8)


def fragmented(pages: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < pages:
        lens.append(min(int(rng.integers(1, 9)), pages - sum(lens)))

    def place() -> np.ndarray:
        order = rng.permutation(len(lens))
        pos = np.empty(len(lens), dtype=np.int64)
        pos[order] = np.concatenate(([0], np.cumsum([lens[k] for k in order])[:-1]))
        return np.concatenate([np.arange(pos[k], pos[k] + lens[k]) for k in range(len(lens))])

    return place().astype(np.int32), place().astype(np.int32)


def _receiver(
    conn: Connection, gpu: str, layers: int, nbytes: int, page_bytes: int, dry: bool
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        dev = Device(dry)
        from transports.ucx import UCXTransport

        bufs = [dev.zeros(nbytes) for _ in range(layers)]
        dev.sync()
        t = UCXTransport()
        t.register_buffers(bufs, [page_bytes] * layers)
        conn.send(("ok", (t.endpoint(), t.layout(), dev.kind)))
        while True:
            cmd = conn.recv()
            if cmd == "digest":
                dev.sync()
                conn.send(("ok", [hashlib.sha256(dev.download(b).data).hexdigest() for b in bufs]))
            elif cmd == "zero":
                for b in bufs:
                    if dev.kind in ("cupy", "numpy"):
                        b.fill(0)
                    else:
                        b.zero_()
                dev.sync()
                conn.send(("ok", None))
            else:
                t.close()
                conn.send(("ok", None))
                return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _sender(
    conn: Connection,
    gpu: str,
    layers: int,
    nbytes: int,
    page_bytes: int,
    endpoint: bytes,
    layout: dict[str, Any],
    rx: Connection,
    reps: int,
    dry: bool,
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        dev = Device(dry)
        from transports.base import Target
        from transports.ucx import UCXTransport

        bufs = [dev.upload(host_layer(i, nbytes)) for i in range(layers)]
        dev.sync()  # UCX does not synchronise streams: the pages must be written first
        t = UCXTransport()
        t.register_buffers(bufs, [page_bytes] * layers)
        pages = nbytes // page_bytes
        ident = np.arange(pages, dtype=np.int32)
        out: dict[str, Any] = {}
        for name, (src, dst) in (("contiguous", (ident, ident)), ("fragmented", fragmented(pages))):
            rx.send("zero")
            rx.recv()
            target = [Target(endpoint, layout, dst)]
            t.write(1, src, target, 60.0)  # warm-up (connection, registration caches)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                t.write(1, src, target, 60.0)
                times.append(time.perf_counter() - t0)
            rx.send("digest")
            status, got = rx.recv()
            want = []
            for layer in range(layers):
                s = host_layer(layer, nbytes).reshape(pages, page_bytes)
                d = np.zeros_like(s)
                d[dst] = s[src]
                want.append(hashlib.sha256(d.data).hexdigest())
            out[name] = {"median_s": statistics.median(times), "verified": got == want}
        # In-process device copy of the same bytes: the local ceiling.
        dst_bufs = [dev.zeros(nbytes) for _ in range(layers)]
        times = []
        for _ in range(reps):
            dev.sync()
            t0 = time.perf_counter()
            for d, s in zip(dst_bufs, bufs, strict=True):
                dev.copy(d, s)
            dev.sync()
            times.append(time.perf_counter() - t0)
        out["device copy"] = {"median_s": statistics.median(times), "verified": None}
        t.close()
        conn.send(("ok", (dev.kind, out)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--proto-info", action="store_true", help="print UCX protocol choices")
    ap.add_argument(
        "--host-dry-run",
        action="store_true",
        help="numpy arrays instead of device arrays (checks the plumbing, no GPU)",
    )
    args = ap.parse_args(argv)

    count, lines = nvml_facts()
    for line in lines:
        print(f"nvml: {line}")
    if args.host_dry_run:
        count = max(count, 1)
    elif count == 0:
        print("no NVIDIA GPU visible: nothing to check", file=sys.stderr)
        return NO_GPU
    if not Device(args.host_dry_run).kind:
        print(
            "neither cupy nor torch with CUDA is importable: cannot allocate device arrays",
            file=sys.stderr,
        )
        return NO_GPU
    if args.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    if args.host_dry_run:  # take the UCX put path, as device memory does
        os.environ["KVSTATE_UCX_CMA"] = "0"

    page_bytes = args.page_kib * 1024
    nbytes = args.pages * page_bytes
    total = nbytes * args.layers
    rx_gpu, tx_gpu = ("1", "0") if count >= 2 and not args.host_dry_run else ("0", "0")
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    rxp = ctx.Process(
        target=_receiver,
        args=(b, rx_gpu, args.layers, nbytes, page_bytes, args.host_dry_run),
        daemon=True,
    )
    rxp.start()
    code = 1
    try:
        if not a.poll(120):
            print("receiver did not start", file=sys.stderr)
            return 1
        status, info = a.recv()
        if status != "ok":
            print(info, file=sys.stderr)
            return 1
        endpoint, layout, kind = info
        c, d = ctx.Pipe()
        txp = ctx.Process(
            target=_sender,
            args=(
                d,
                tx_gpu,
                args.layers,
                nbytes,
                page_bytes,
                endpoint,
                layout,
                a,
                args.reps,
                args.host_dry_run,
            ),
            daemon=True,
        )
        txp.start()
        if not c.poll(300):
            print("sender did not finish", file=sys.stderr)
            txp.kill()
            return 1
        status, res = c.recv()
        txp.join(10)
        if status != "ok":
            print(res, file=sys.stderr)
            return 1
        kind, out = res
        print(
            f"{args.layers} layers x {args.pages} pages x {args.page_kib} KiB "
            f"({total / 2**20:.0f} MiB) with {kind}; receiver GPU {rx_gpu}, sender GPU {tx_gpu}"
        )
        base = total / out["device copy"]["median_s"] / 1e9
        for name, r in out.items():
            bw = total / r["median_s"] / 1e9
            print(
                f"  {name:<12} {bw:8.2f} GB/s  {bw / base:5.2f} x device copy  "
                f"verified={r['verified']}"
            )
        code = 0 if all(r["verified"] in (True, None) for r in out.values()) else 1
        print("OK: every byte verified" if code == 0 else "MISMATCH: receiver bytes differ")
        return code
    finally:
        with contextlib.suppress(OSError):
            a.send("stop")
        rxp.join(10)
        if rxp.is_alive():
            rxp.kill()


if __name__ == "__main__":
    sys.exit(main())
