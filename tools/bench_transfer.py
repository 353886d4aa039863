#!/usr/bin/env python3
"""Data-plane benchmark: KV pages between two processes, side by side with baselines.

Moves the same pages (default 4 layers x 1024 pages x 16 KiB = 4096 pages,
64 MiB) contiguously and fragmented (runs of 1-8 pages at random places on
both sides) with:

* ``UCXTransport`` as configured by default (same-host: batched CMA);
* ``UCXTransport`` forced through UCX puts (``cma=False``: the path used across
  hosts and for GPU memory; error-handling endpoints, TCP on one host);
* raw ``ucxx``: the same bytes as one tagged message plus a 1-byte ack, with
  endpoint error handling off (shared memory / CMA, the fastest UCX gets here)
  and on (the setting the transport's UCX path uses);
* ``numpy`` memcpy inside one process (the ceiling);
* NIXL (UCX backend, default settings, one descriptor per run, transfer
  prepared per request) and Mooncake Transfer Engine (``tcp``), when installed.

Every system runs in its own pair of ``spawn``-ed processes; the receiver's
bytes are checked (SHA-256 of every layer) after each layout. Figures are
medians over ``--reps`` runs after warm-up; compare ratios within one run only
(the host may be shared).

Usage: ``python tools/bench_transfer.py [--json] [--plot out.png] [--reps N]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Mooncake's TCP transport queues at most this many entries per peer (facts file).
os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "8192")


@dataclass(frozen=True)
class Config:
    layers: int = 4
    pages: int = 1024  # per layer
    page_bytes: int = 16384
    reps: int = 7
    warmup: int = 2

    @property
    def total_bytes(self) -> int:
        return self.layers * self.pages * self.page_bytes


def sender_layer(cfg: Config, layer: int) -> np.ndarray:
    rng = np.random.default_rng(1234 + layer)
    return rng.integers(0, 256, size=cfg.pages * cfg.page_bytes, dtype=np.uint8)


def runs_layout(n: int, run_min: int, run_max: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """All ``n`` pages cut into runs of run_min..run_max pages, placed in independent
    random orders on the source and the destination side."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < n:
        lens.append(min(int(rng.integers(run_min, run_max + 1)), n - sum(lens)))
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))

    def place() -> np.ndarray:
        order = rng.permutation(len(lens))
        pos = np.empty(len(lens), dtype=np.int64)
        pos[order] = np.concatenate(([0], np.cumsum([lens[k] for k in order])[:-1]))
        return np.concatenate([np.arange(pos[k], pos[k] + lens[k]) for k in range(len(lens))])

    del starts
    return place().astype(np.int32), place().astype(np.int32)


def digests(bufs: list[np.ndarray]) -> list[str]:
    return [hashlib.sha256(b.data).hexdigest() for b in bufs]


def expected_digests(cfg: Config, src: np.ndarray, dst: np.ndarray) -> list[str]:
    out = []
    for layer in range(cfg.layers):
        s = sender_layer(cfg, layer).reshape(cfg.pages, cfg.page_bytes)
        d = np.zeros_like(s)
        d[dst] = s[src]
        out.append(hashlib.sha256(d.data).hexdigest())
    return out


def timed(fn: Callable[[], None], cfg: Config, reps: int | None = None) -> list[float]:
    for _ in range(cfg.warmup):
        fn()
    out = []
    for _ in range(reps or cfg.reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------
# Receivers (one per system) and senders, each in its own process.


def _rx_main(system: str, cfg: Config, conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        bufs = [np.zeros(cfg.pages * cfg.page_bytes, dtype=np.uint8) for _ in range(cfg.layers)]
        for b in bufs:
            b.fill(1)  # touch every page now, not during the first timed transfer
        info: dict[str, Any] = {"addrs": [int(b.ctypes.data) for b in bufs]}
        keep: Any = None
        if system == "kvstate":
            from transports.ucx import UCXTransport

            keep = UCXTransport()
            keep.register_buffers(bufs, [cfg.page_bytes] * cfg.layers)
            info.update(endpoint=keep.endpoint(), layout=keep.layout())
        elif system == "ucxx":
            keep = _RawUcxx(bufs)
            info.update(address=keep.address)
        elif system == "nixl":
            from nixl._api import nixl_agent, nixl_agent_config

            keep = nixl_agent("rx", nixl_agent_config(backends=[]))
            keep.create_backend("UCX", {})
            keep.register_memory([(int(b.ctypes.data), b.nbytes, 0, "") for b in bufs], "DRAM")
            info.update(meta=keep.get_agent_metadata())
        elif system == "mooncake":
            from mooncake.engine import TransferEngine

            keep = TransferEngine()
            if keep.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("Mooncake initialize failed")
            for b in bufs:
                keep.register_memory(int(b.ctypes.data), b.nbytes)
            info.update(target=f"127.0.0.1:{keep.get_rpc_port()}")
        conn.send(("ok", info))
        while True:
            cmd, *args = conn.recv()
            if cmd == "reset":
                for b in bufs:
                    b.fill(0)
                conn.send(("ok", None))
            elif cmd == "digest":
                conn.send(("ok", digests(bufs)))
            elif cmd == "ucxx_recv":
                conn.send(("ok", keep.serve(*args)))
            elif cmd == "stop":
                conn.send(("ok", None))
                return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class _RawUcxx:
    """One message of all bytes, as plain ucxx would send it (receiver side)."""

    def __init__(self, bufs: list[np.ndarray]) -> None:
        from transports.ucx import run_on_ucx_thread

        self.run = run_on_ucx_thread
        self.bufs = bufs
        self.flat = np.zeros(sum(b.nbytes for b in bufs), dtype=np.uint8)
        self.flat.fill(1)
        import ucxx

        self.ucxx = ucxx
        self.address = self.run(self._address(), 30)

    async def _address(self) -> bytes:
        return bytes(self.ucxx.get_worker_address())

    def serve(self, count: int, peer: bytes, error_handling: bool) -> bool:
        return self.run(self._serve(count, peer, error_handling), 300)

    async def _serve(self, count: int, peer: bytes, error_handling: bool) -> bool:
        ucxx = self.ucxx
        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(peer), endpoint_error_handling=error_handling
        )
        ack = np.ones(1, dtype=np.uint8)
        for _ in range(count):
            await ucxx.recv(self.flat, tag=11)
            await ep.send(ack, tag=12, force_tag=True)
        # Leave the bytes where the digest looks: layer by layer.
        off = 0
        for b in self.bufs:
            b[:] = self.flat[off:off + b.nbytes]
            off += b.nbytes
        ep.abort()
        return True


def _tx_main(system: str, cfg: Config, info: dict[str, Any], layouts: dict[str, Any],
             conn: Connection, rx: Connection, env: dict[str, str]) -> None:
    """Sender: time each layout; asks the receiver for digests between layouts."""
    os.environ.update(env)
    try:
        bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]
        results: dict[str, Any] = {}

        def rx_call(*msg: Any) -> Any:
            rx.send(msg)
            status, value = rx.recv()
            if status != "ok":
                raise RuntimeError(value)
            return value

        def check(name: str, src: np.ndarray, dst: np.ndarray) -> None:
            ok = rx_call("digest") == expected_digests(cfg, src, dst)
            results[name]["verified"] = ok
            if not ok:
                raise RuntimeError(f"{system}/{name}: receiver bytes differ")

        if system in ("kvstate", "kvstate-ucx"):
            from transports.base import Target
            from transports.ucx import UCXSettings, UCXTransport

            t = UCXTransport(UCXSettings(cma=system == "kvstate"))
            t.register_buffers(bufs, [cfg.page_bytes] * cfg.layers)
            reps = cfg.reps if system == "kvstate" else 3
            def writer(src: np.ndarray, dst: np.ndarray) -> Callable[[], None]:
                targets = [Target(info["endpoint"], info["layout"], dst)]
                return lambda: t.write(1, src, targets, 60.0)

            writes = {name: writer(src, dst) for name, (src, dst) in layouts.items()}
            # Alternate the layouts rep by rep so load from elsewhere hits them alike.
            for _ in range(cfg.warmup):
                for write in writes.values():
                    write()
            per_layout: dict[str, list[float]] = {name: [] for name in writes}
            for _ in range(reps):
                for name, write in writes.items():
                    t0 = time.perf_counter()
                    write()
                    per_layout[name].append(time.perf_counter() - t0)
            for name, (src, dst) in layouts.items():
                rx_call("reset")
                writes[name]()
                results[name] = {"times": per_layout[name]}
                check(name, src, dst)
        elif system in ("ucxx", "ucxx-polling"):
            import ucxx

            from transports.ucx import run_on_ucx_thread

            flat = np.concatenate(bufs)
            ack = np.zeros(1, dtype=np.uint8)
            me = run_on_ucx_thread(_ucxx_address(), 30)
            for name, eh in (("one message, error handling off", False),
                             ("one message, error handling on", True)):
                count = cfg.warmup + (cfg.reps if not eh else 3)
                rx_call("reset")
                rx.send(("ucxx_recv", count, me, eh))
                ep = run_on_ucx_thread(ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(info["address"]),
                    endpoint_error_handling=eh), 30)

                async def one(ep: Any = ep) -> None:
                    await ep.send(flat, tag=11, force_tag=True)
                    await ucxx.recv(ack, tag=12)

                def send_one(one: Callable[[], Any] = one) -> None:
                    run_on_ucx_thread(one(), 60)

                times = timed(send_one, cfg, count - cfg.warmup)
                status, value = rx.recv()
                if status != "ok":
                    raise RuntimeError(value)
                results[name] = {"times": times}
                ident = np.arange(cfg.pages)
                check(name, ident, ident)
                ep.abort()
        elif system == "nixl":
            from nixl._api import nixl_agent, nixl_agent_config

            agent = nixl_agent("tx", nixl_agent_config(backends=[]))
            agent.create_backend("UCX", {})
            agent.register_memory([(int(b.ctypes.data), b.nbytes, 0, "") for b in bufs], "DRAM")
            peer = agent.add_remote_agent(info["meta"])
            for name, (src, dst) in layouts.items():
                local, remote = _descs(cfg, bufs, info["addrs"], src, dst)
                sd = agent.get_xfer_descs(local, "DRAM")
                dd = agent.get_xfer_descs(remote, "DRAM")
                # Prepared once and re-posted: NIXL's best case (a real request would
                # build its descriptors each time, as kvstate's write() does).
                h = agent.initialize_xfer("WRITE", sd, dd, peer, b"")

                def xfer(h: Any = h) -> None:
                    state = agent.transfer(h)
                    while state not in ("DONE", "ERR"):
                        state = agent.check_xfer_state(h)
                    if state == "ERR":
                        raise RuntimeError("NIXL transfer failed")

                rx_call("reset")
                results[name] = {"times": timed(xfer, cfg)}
                check(name, src, dst)
                agent.release_xfer_handle(h)
        elif system == "mooncake":
            from mooncake.engine import TransferEngine

            te = TransferEngine()
            if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("Mooncake initialize failed")
            for b in bufs:
                te.register_memory(int(b.ctypes.data), b.nbytes)
            for name, (src, dst) in layouts.items():
                local, remote = _descs(cfg, bufs, info["addrs"], src, dst)
                la, ra, ln = (local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist())

                def mc(la: list[int] = la, ra: list[int] = ra, ln: list[int] = ln) -> None:
                    if te.batch_transfer_sync_write(info["target"], la, ra, ln) != 0:
                        raise RuntimeError("Mooncake transfer failed")

                rx_call("reset")
                results[name] = {"times": timed(mc, cfg, 3)}
                check(name, src, dst)
        conn.send(("ok", results))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _ucxx_address() -> bytes:
    import ucxx

    return bytes(ucxx.get_worker_address())


def _descs(cfg: Config, bufs: list[np.ndarray], remote_addrs: list[int], src: np.ndarray,
           dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(addr, len, dev) rows, one per run and layer: what NIXL and Mooncake are given."""
    from transports.pages import merge_runs

    runs = merge_runs(src, dst)
    pb = cfg.page_bytes
    local, remote = [], []
    for b, raddr in zip(bufs, remote_addrs, strict=True):
        n = runs.length * pb
        local.append(np.stack([int(b.ctypes.data) + runs.src * pb, n, np.zeros_like(n)], 1))
        remote.append(np.stack([raddr + runs.dst * pb, n, np.zeros_like(n)], 1))
    return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)


def run_system(system: str, cfg: Config, layouts: dict[str, Any]) -> dict[str, Any]:
    """Spawn receiver and sender for one system; return per-layout results."""
    ctx = multiprocessing.get_context("spawn")
    rx_kind = system.split("-")[0]
    # ucxx-polling: raw ucxx at its fastest here (a core spins on each side).
    env = {"KVSTATE_UCX_PROGRESS_MODE": "polling"} if system == "ucxx-polling" else {}
    a, b = ctx.Pipe()
    rxp = ctx.Process(target=_rx_main, args=(rx_kind, cfg, b, env), daemon=True)
    rxp.start()
    txp = None
    try:
        if not a.poll(120):
            raise RuntimeError("receiver did not start")
        status, info = a.recv()
        if status != "ok":
            raise RuntimeError(info)
        c, d = ctx.Pipe()
        txp = ctx.Process(target=_tx_main, args=(system, cfg, info, layouts, d, a, env),
                          daemon=True)
        txp.start()
        if not c.poll(300):
            raise RuntimeError("sender did not finish")
        status, res = c.recv()
        if status != "ok":
            raise RuntimeError(res)
        return dict(res)
    finally:
        with _suppress():
            if txp is not None:
                txp.join(10)
            a.send(("stop",))
            a.poll(10)
        rxp.join(5)
        for p in (txp, rxp):
            if p is not None and p.is_alive():
                p.kill()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def memcpy_baseline(cfg: Config, layouts: dict[str, Any]) -> dict[str, Any]:
    """In-process copies of the same runs: the ceiling for moving these bytes."""
    from transports.pages import merge_runs

    src_bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]
    dst_bufs = [np.ones_like(b) for b in src_bufs]
    pb = cfg.page_bytes
    out = {}
    for name, (src, dst) in layouts.items():
        runs = merge_runs(src, dst)
        spans = list(zip((runs.src * pb).tolist(), (runs.dst * pb).tolist(),
                         (runs.length * pb).tolist(), strict=True))

        def copy(spans: list[tuple[int, int, int]] = spans) -> None:
            for s, d in zip(src_bufs, dst_bufs, strict=True):
                for so, do, n in spans:
                    d[do:do + n] = s[so:so + n]

        out[name] = {"times": timed(copy, cfg)}
    return out


def gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def available(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--plot", metavar="PNG", help="bandwidth vs page-run length (matplotlib)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=1024, help="pages per layer")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list: nixl,mooncake,ucx-path,ucxx")
    args = ap.parse_args(argv)
    cfg = Config(args.layers, args.pages, args.page_kib * 1024, args.reps)
    skip = set(filter(None, args.skip.split(",")))
    say: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print

    ident = np.arange(cfg.pages, dtype=np.int32)
    layouts = {"contiguous": (ident, ident), "fragmented": runs_layout(cfg.pages, 1, 8, 42)}
    from transports.pages import merge_runs

    frag_runs = len(merge_runs(*layouts["fragmented"]).length)
    say(f"{cfg.layers} layers x {cfg.pages} pages x {cfg.page_bytes // 1024} KiB = "
        f"{cfg.total_bytes / 2**20:.0f} MiB; fragmented: {frag_runs} runs per layer "
        f"({frag_runs * cfg.layers} in all); host {socket.gethostname()}, "
        f"{os.cpu_count()} CPUs; median of {cfg.reps} after {cfg.warmup} warm-up")

    started = time.perf_counter()
    results: dict[str, Any] = {}
    notes: list[str] = []
    plan: list[tuple[str, str]] = [("kvstate", "kvstate (default: same-host CMA)")]
    if "ucx-path" not in skip:
        plan.append(("kvstate-ucx", "kvstate forced through UCX puts"))
    if "ucxx" not in skip:
        plan.append(("ucxx", "raw ucxx (blocking progress, as the transport)"))
        plan.append(("ucxx-polling", "raw ucxx (polling progress)"))
    for mod, system, label in (("nixl", "nixl", "NIXL (UCX backend)"),
                               ("mooncake", "mooncake", "Mooncake TE (tcp)")):
        if system in skip:
            notes.append(f"{label}: skipped (--skip)")
        elif not available(mod):
            notes.append(f"{label}: not installed (see research/transport-facts.md)")
        else:
            plan.append((system, label))
    for system, label in plan:
        say(f"running {label} ...")
        try:
            results[system] = run_system(system, cfg, layouts)
        except Exception as exc:
            notes.append(f"{label}: failed: {str(exc).splitlines()[0]}")
    results["memcpy"] = memcpy_baseline(cfg, layouts)

    rows: list[dict[str, Any]] = []
    for system, per in results.items():
        for name, r in per.items():
            rows.append({
                "system": system, "case": name,
                "gbps": round(gbps(cfg.total_bytes, r["times"]), 3),
                "median_ms": round(statistics.median(r["times"]) * 1e3, 2),
                "reps": len(r["times"]), "verified": r.get("verified"),
            })

    def rate(system: str, case: str) -> float | None:
        for row in rows:
            if row["system"] == system and row["case"] == case:
                return float(row["gbps"])
        return None

    ratios: dict[str, float | None] = {}

    def ratio(key: str, a: float | None, b: float | None) -> None:
        ratios[key] = round(a / b, 3) if a and b else None

    k_c, k_f = rate("kvstate", "contiguous"), rate("kvstate", "fragmented")
    ratio("contiguous / raw ucxx one message (error handling off)  [>= 0.9]", k_c,
          rate("ucxx", "one message, error handling off"))
    ratio("contiguous / raw ucxx one message (error handling on)", k_c,
          rate("ucxx", "one message, error handling on"))
    ratio("contiguous / raw ucxx, polling progress, error handling off", k_c,
          rate("ucxx-polling", "one message, error handling off"))
    ratio("fragmented / contiguous  [>= 0.7]", k_f, k_c)
    ratio("contiguous / NIXL contiguous  [>= 1.0]", k_c, rate("nixl", "contiguous"))
    ratio("fragmented / NIXL fragmented  [>= 1.0]", k_f, rate("nixl", "fragmented"))
    ratio("contiguous / Mooncake contiguous", k_c, rate("mooncake", "contiguous"))
    ratio("fragmented / Mooncake fragmented", k_f, rate("mooncake", "fragmented"))
    ratio("UCX-put path fragmented / contiguous", rate("kvstate-ucx", "fragmented"),
          rate("kvstate-ucx", "contiguous"))
    ratio("contiguous / in-process memcpy", k_c, rate("memcpy", "contiguous"))
    ratio("fragmented / in-process memcpy", k_f, rate("memcpy", "fragmented"))

    sweep: list[dict[str, Any]] = []
    if args.plot:
        sweep = run_sweep(cfg)
        notes.append(plot(sweep, args.plot))

    doc = {"config": cfg.__dict__ | {"total_bytes": cfg.total_bytes,
                                     "fragmented_runs_per_layer": frag_runs},
           "results": rows, "ratios": ratios, "sweep": sweep, "notes": notes,
           "wall_s": round(time.perf_counter() - started, 1)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"\n{'system':<14}{'case':<34}{'GB/s':>8}{'ms':>9}  verified")
        for row in rows:
            print(f"{row['system']:<14}{row['case']:<34}{row['gbps']:>8.2f}"
                  f"{row['median_ms']:>9.2f}  {row['verified']}")
        print("\nratios:")
        for key, val in ratios.items():
            print(f"  {key:<66} {'n/a' if val is None else f'{val:.2f}'}")
        if sweep:
            print("\nrun-length sweep (kvstate default path):")
            for point in sweep:
                print(f"  runs of {point['run_pages']:>4} pages: {point['gbps']:.2f} GB/s")
        for note in notes:
            print(f"note: {note}")
        print(f"wall time {doc['wall_s']} s")
    return 0 if all(r["verified"] in (True, None) for r in rows) else 1


def run_sweep(cfg: Config) -> list[dict[str, Any]]:
    """kvstate bandwidth for fixed run lengths (the plot's data)."""
    lengths = [n for n in (1, 2, 4, 8, 16, 64, 256, cfg.pages) if n <= cfg.pages]
    layouts = {f"runs of {n}": runs_layout(cfg.pages, n, n, 7 + n) for n in lengths}
    res = run_system("kvstate", Config(cfg.layers, cfg.pages, cfg.page_bytes, 5, 1), layouts)
    return [{"run_pages": n, "gbps": round(gbps(cfg.total_bytes, res[f"runs of {n}"]["times"]), 3)}
            for n in lengths]


def plot(sweep: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed; the sweep is printed instead"
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["run_pages"] for p in sweep], [p["gbps"] for p in sweep], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pages per run")
    ax.set_ylabel("GB/s")
    ax.set_title("kvstate UCXTransport: bandwidth vs page-run length")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"


if __name__ == "__main__":
    sys.exit(main())
