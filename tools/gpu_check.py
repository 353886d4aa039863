#!/usr/bin/env python3
"""GPU check for a machine with an NVIDIA GPU: device KV pages through UCXTransport.

Run on the GPU machine (one short script, a few seconds):

    python tools/gpu_check.py [--layers 4] [--pages 1024] [--page-kib 16] [--proto-info]
                              [--nixl] [--ucx-lanes] [--json] [--host-dry-run]

1. Prints NVML facts (driver, each GPU's name, UUID, PCI bus id, memory, NVLink
   links, topology between GPUs) from ``pynvml`` (package nvidia-ml-py).
2. Spawns a receiver and a sender process, each holding device arrays (cupy,
   else torch), registered with ``UCXTransport`` without host copies; with two
   or more GPUs the receiver uses GPU 1 and the sender GPU 0.
3. Writes all pages contiguously, then fragmented (runs of 1-8 pages at random
   places); the receiver copies its arrays to the host once and checks every
   byte against what the sender's pages predict.
4. Prints GB/s of each against an in-process device-to-device copy.

``--nixl`` moves the same pages with NIXL 1.5 (UCX backend, WRITE, error handling
on) between the same GPUs and prints kvstate / NIXL per layout (issue 33 target 1,
same host: cuda_ipc between the GPUs of one node); ``--ucx-lanes`` says which UCX
transports and put protocols each side's endpoints took (UCX's info log and protocol
tables, read back from files; see tools/bench/transfer/lanes.py); ``--json`` prints
one JSON document.

``--host-dry-run`` runs the same processes on numpy arrays through the same
UCX put path (no GPU needed) to check the script itself (and NIXL's side, on host
memory, where NIXL is installed).

Exit status: 0 all bytes verified; 1 a mismatch or a transfer error; 2 no GPU
(or neither cupy nor torch with CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from tools import gpu_nixl  # noqa: E402
from tools.gpu_arrays import Device, digests, expected, fragmented, host_layer  # noqa: E402

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
                conn.send(("ok", digests(dev, bufs)))
            elif cmd == "zero":
                dev.zero(bufs)
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
            want = expected(layers, nbytes, page_bytes, src, dst)
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


def run_pair(
    rx_target: Any, rx_args: tuple[Any, ...], tx_target: Any, tx_args: Any
) -> tuple[str, dict[str, Any]]:
    """A receiver process, then a sender given ``tx_args(receiver_info, rx_conn)``;
    (array kind, results) or a RuntimeError with what went wrong."""
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    rxp = ctx.Process(target=rx_target, args=(b, *rx_args), daemon=True)
    rxp.start()
    try:
        if not a.poll(120):
            raise RuntimeError("receiver did not start")
        status, info = a.recv()
        if status != "ok":
            raise RuntimeError(info)
        c, d = ctx.Pipe()
        txp = ctx.Process(target=tx_target, args=(d, *tx_args(info, a)), daemon=True)
        txp.start()
        if not c.poll(300):
            txp.kill()
            raise RuntimeError("sender did not finish")
        status, res = c.recv()
        txp.join(10)
        if status != "ok":
            raise RuntimeError(res)
        return res  # type: ignore[no-any-return]
    finally:
        with contextlib.suppress(OSError):
            a.send("stop")
        rxp.join(10)
        if rxp.is_alive():
            rxp.kill()


def lanes_env(directory: str, key: str) -> None:
    """UCX's endpoint lanes and protocol tables of the next processes into files
    (tools/bench/transfer/lanes.py reads them back)."""
    os.environ.update(
        UCX_LOG_LEVEL="info",
        UCX_PROTO_INFO="y",
        UCX_LOG_FILE=f"{directory}/gpu.{key}.%p.log",
    )


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
    ap.add_argument(
        "--nixl",
        action="store_true",
        help="the same pages by NIXL (UCX backend, error handling on), ratios kvstate/NIXL",
    )
    ap.add_argument(
        "--ucx-lanes",
        action="store_true",
        help="which UCX transports and put protocols each side's endpoints used",
    )
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    out = sys.stdout
    if args.json:  # NIXL's libraries log to stdout, children too: keep it for the document
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    count, lines = nvml_facts()
    for line in lines:
        say(f"nvml: {line}")
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
    dry, reps, layers = args.host_dry_run, args.reps, args.layers
    lanes_dir = tempfile.mkdtemp(prefix="kvstate-gpu-lanes-") if args.ucx_lanes else None
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    kind = ""
    try:
        if lanes_dir:
            lanes_env(lanes_dir, "kvstate")
        kind, results["kvstate"] = run_pair(
            _receiver,
            (rx_gpu, layers, nbytes, page_bytes, dry),
            _sender,
            lambda info, rx: (tx_gpu, layers, nbytes, page_bytes, info[0], info[1], rx, reps, dry),
        )
        if args.nixl and not gpu_nixl.available():
            notes.append("NIXL not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)")
        elif args.nixl:
            if lanes_dir:
                lanes_env(lanes_dir, "nixl")
            _, results["nixl"] = run_pair(
                gpu_nixl.receiver,
                (rx_gpu, layers, nbytes, dry, "peer"),
                gpu_nixl.sender,
                lambda info, rx: (tx_gpu, layers, nbytes, page_bytes, info, rx, reps, dry, "peer"),
            )
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        for var in ("UCX_LOG_LEVEL", "UCX_LOG_FILE"):
            os.environ.pop(var, None)
    base = total / results["kvstate"].pop("device copy")["median_s"] / 1e9
    doc: dict[str, Any] = {
        "config": {"layers": layers, "pages": args.pages, "page_kib": args.page_kib},
        "arrays": kind,
        "memory": "host (dry run)" if dry else "device",
        "receiver_gpu": rx_gpu,
        "sender_gpu": tx_gpu,
        "device_copy_gbps": round(base, 3),
        "results": {
            system: {
                case: {"gbps": round(total / r["median_s"] / 1e9, 3), "verified": r["verified"]}
                for case, r in out.items()
            }
            for system, out in results.items()
        },
        "notes": notes,
    }
    if "nixl" in results:
        doc["ratios_kvstate_over_nixl"] = {
            case: round(r["gbps"] / doc["results"]["nixl"][case]["gbps"], 3)
            for case, r in doc["results"]["kvstate"].items()
        }
    if lanes_dir:
        from tools.bench.transfer.lanes import read

        doc["ucx_lanes"] = read(lanes_dir).get("gpu", {})
        shutil.rmtree(lanes_dir, ignore_errors=True)
    code = 0 if all(r["verified"] for out in results.values() for r in out.values()) else 1
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
        out.flush()
    else:
        print(
            f"{layers} layers x {args.pages} pages x {args.page_kib} KiB "
            f"({total / 2**20:.0f} MiB) with {kind}; receiver GPU {rx_gpu}, sender GPU {tx_gpu}"
        )
        print(f"  device copy   {base:8.2f} GB/s")
        for system, out in doc["results"].items():
            for case, r in out.items():
                print(
                    f"  {system:<8} {case:<12} {r['gbps']:8.2f} GB/s  "
                    f"{r['gbps'] / base:5.2f} x device copy  verified={r['verified']}"
                )
        for case, ratio in doc.get("ratios_kvstate_over_nixl", {}).items():
            print(f"  kvstate / NIXL {case}: {ratio:.2f}")
        for system, found in doc.get("ucx_lanes", {}).items():
            for line in found:
                print(f"  ucx lanes {system}: {line}")
        for note in notes:
            print(f"note: {note}")
        print("OK: every byte verified" if code == 0 else "MISMATCH: receiver bytes differ")
    return code


if __name__ == "__main__":
    sys.exit(main())
