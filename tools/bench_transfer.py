#!/usr/bin/env python3
"""Data-plane benchmark: KV pages between two processes, side by side with baselines.

Moves the same pages (default 4 layers x 1024 pages x 16 KiB = 4096 pages,
64 MiB) contiguously and fragmented (runs of 1-8 pages at random places on
both sides), each system in its own pair of ``spawn``-ed processes:

* kvstate ``UCXTransport`` with its defaults. Every row names the path it
  measures: **CMA** (same host, host memory: batched ``process_vm_writev``, a
  large write split over two threads) or **UCX** (``ucp_put_nbx`` of at most
  64 KiB each + flush, error handling on: other hosts, GPU memory, or
  ``KVSTATE_UCX_CMA=0``); ``--extra`` adds kvstate rows with other settings;
* raw ``ucxx``: all bytes as one tagged message plus a 1-byte ack, tuned
  (``UCX_RNDV_SCHEME=put_zcopy``), error handling off (its fastest) and on;
* the peers, when installed, each with every setting that was its best in some
  run here, one row per setting; ratios take the best row of the run:
  NIXL 1.5 (UCX backend; error handling off and on; UCX's own TCP segment
  sizes and kvstate's 256K/512K, which NIXL's UCX reads from the environment
  too; transfer prepared once and re-posted) and Mooncake Transfer Engine
  (``tcp``, ``--mooncake-lanes``, default 1, 2, 4, 8 and 16 lanes);
* a plain TCP socket (gather/scatter ``sendmsg``/``recv_into``);
* numpy memcpy inside one process (the ceiling on one host), timed in turn
  like the rest, and once more alone after the run (the old, kinder figure).

``--cross-host`` puts the receiver and the sender in two network namespaces
joined by a veth pair that the tool creates (10.231.0.1/2, inside those
namespaces only; removed afterwards), CMA off and every UCX user on
``UCX_TLS=tcp``: the stand-in for two hosts on one machine. Where namespaces
cannot be made (not root, no ``ip``), it falls back to loopback with CMA off
and says so.

Every system gets the same warm-up and reps: all pairs are started first, then
timed in turn one rep at a time, in a new random order every rep (layouts
alternating within a rep; the pairs not being timed are SIGSTOPped), so load
from elsewhere, and whatever ran just before, hits them alike; the receiver's
bytes are checked (SHA-256 of every layer) after the timed part.
Figures: median GB/s and the spread (slowest..fastest rep). Compare ratios
within one run only: the host may be shared (the load average is printed).

Usage: ``python tools/bench_transfer.py [--cross-host] [--json] [--plot out.png] [--reps N]
[--mooncake-lanes 1,2,4,8,16] [--extra NAME:VAR=VALUE,...] [--skip ...]``
(``--plot`` runs both the same-host and the cross-host set).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Mooncake's TCP transport queues at most this many entries per peer (facts file).
os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "8192")

NETNS_ADDR = ("10.231.0.1", "10.231.0.2")  # sender, receiver: inside the namespaces only
IOV_MAX = 1024


@dataclass(frozen=True)
class Config:
    layers: int = 4
    pages: int = 1024  # per layer
    page_bytes: int = 16384
    reps: int = 5
    warmup: int = 2

    @property
    def total_bytes(self) -> int:
        return self.layers * self.pages * self.page_bytes


# How to install each optional peer (docs/development.md's lines). No pip extra does:
# NIXL's requirements pull a torch built for CUDA 13, which breaks kvstate[ucx]'s CUDA 12
# build (ucxx-cu12); --no-deps leaves the [test] environment as it is.
INSTALL = {
    "nixl": "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda, with libibverbs1 from apt",
}


@dataclass(frozen=True)
class System:
    """One row group of the report: who moves the bytes, and with which settings."""

    key: str
    label: str
    kind: str  # receiver/sender implementation
    path: str = "-"  # for kvstate: which path the row measures (CMA or UCX)
    env: dict[str, str] = field(default_factory=dict)
    module: str = ""  # optional peer: skipped with a note when not importable
    nixl_error_handling: str = "none"  # NIXL's ucx_error_handling_mode
    family: str = ""  # the peer a ratio compares with: the best of its settings counts

    def settings(self) -> dict[str, str]:
        """What this row was run with, for the JSON (environment and peer options)."""
        out = dict(self.env)
        if self.kind == "nixl":
            out["ucx_error_handling_mode"] = self.nixl_error_handling
        return out


@dataclass(frozen=True)
class Site:
    """Where the two processes run: their network namespaces and addresses."""

    mode: str  # "same-host" or "cross-host"
    tx_ns: str = ""
    rx_ns: str = ""
    tx_addr: str = "127.0.0.1"
    rx_addr: str = "127.0.0.1"
    note: str = ""


#: NIXL with the UCX TCP segment sizes kvstate exports by default (transports.ucx.settings)
KVSTATE_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "512K"}


def systems(
    mode: str, lanes: list[int], extras: tuple[tuple[str, dict[str, str]], ...] = ()
) -> list[System]:
    """The systems a mode compares. Peers run with every setting that was their best in
    some run here: NIXL with error handling off and on, each with UCX's own TCP
    segment sizes and with kvstate's; Mooncake at every lane count in ``lanes``.
    Ratios take each peer's best setting in the run; the rows show them all."""
    cross = mode == "cross-host"
    tcp = {"UCX_TLS": "tcp"} if cross else {}
    # Raw ucxx tuned: put_zcopy rendezvous beat the default scheme over TCP (facts file and
    # a sweep here); blocking progress beat polling on 2 loaded cores; kvstate's TCP segment
    # defaults apply (it runs on the transport's UCX thread).
    tuned = {"UCX_RNDV_SCHEME": "put_zcopy"}
    out = []
    if not cross:
        out.append(
            System("kvstate-cma", "kvstate, same host (CMA path, default)", "kvstate", "CMA")
        )
    out.append(
        System(
            "kvstate-ucx",
            "kvstate, UCX put path"
            + (" (default across hosts)" if cross else " (KVSTATE_UCX_CMA=0)"),
            "kvstate",
            "UCX",
            {"KVSTATE_UCX_CMA": "0"} | tcp,
        )
    )
    for name, env in extras:  # --extra: kvstate with other settings, timed in turn
        # UCX path unless the extra turns CMA back on (same host only).
        cma_row = env.get("KVSTATE_UCX_CMA") == "1"
        if cma_row and cross:
            continue  # the namespaces share a kernel: CMA would reach across them
        out.append(
            System(
                f"kvstate-{name}",
                f"kvstate, {'CMA' if cma_row else 'UCX put'} path, "
                + " ".join(f"{k}={v}" for k, v in env.items()),
                "kvstate",
                "CMA" if cma_row else "UCX",
                {"KVSTATE_UCX_CMA": "0"} | tcp | env,
            )
        )
    out += [
        System(
            "ucxx",
            "raw ucxx, one tag message, tuned, error handling off",
            "ucxx",
            env=tuned | tcp,
            family="ucxx",
        ),
        System(
            "ucxx-eh",
            "raw ucxx, one tag message, tuned, error handling on",
            "ucxx",
            env=tuned | tcp,
            family="ucxx",
        ),
    ]
    # NIXL's UCX backend reads the UCX_* variables: error handling off and on (its
    # default; over TCP either was faster in some runs), each with UCX's segment sizes
    # and with kvstate's.
    for eh, eh_label in (("none", "error handling off"), ("peer", "error handling on")):
        for segs, seg_label in (({}, "UCX's TCP segments"), (KVSTATE_SEGMENTS, "256K/512K")):
            out.append(
                System(
                    "nixl" + ("-eh" if eh == "peer" else "") + ("-seg" if segs else ""),
                    f"NIXL 1.5.1, UCX backend, {eh_label}, {seg_label}",
                    "nixl",
                    env=tcp | segs,
                    module="nixl",
                    nixl_error_handling=eh,
                    family="nixl",
                )
            )
    for n in lanes:
        out.append(
            System(
                f"mooncake-{n}",
                f"Mooncake TE, tcp, {n} lane{'s' if n > 1 else ''}",
                "mooncake",
                env={"MC_TCP_LANES_PER_PEER": str(n)},
                module="mooncake",
                family="mooncake",
            )
        )
    out.append(
        System("socket", "plain TCP socket (sendmsg / recv_into)", "socket", family="socket")
    )
    if not cross:
        out.append(
            System(
                "memcpy",
                "numpy memcpy in one process (timed in turn)",
                "memcpy",
                family="memcpy",
            )
        )
    return out


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

    def place() -> np.ndarray:
        order = rng.permutation(len(lens))
        pos = np.empty(len(lens), dtype=np.int64)
        pos[order] = np.concatenate(([0], np.cumsum([lens[k] for k in order])[:-1]))
        return np.concatenate([np.arange(pos[k], pos[k] + lens[k]) for k in range(len(lens))])

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


def _enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into network namespace ``name``.

    As ``ip netns exec`` does, /sys is remounted in a private mount namespace:
    UCX finds its network devices under /sys/class/net, which otherwise still
    shows the host's devices.
    """
    if not name:
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, 0x40000000), f"setns into {name}")  # CLONE_NEWNET
    finally:
        os.close(fd)
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x80000, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", 2), "umount /sys")  # MNT_DETACH
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


@contextlib.contextmanager
def cross_host_site() -> Iterator[Site]:
    """Two network namespaces joined by a veth pair, removed on exit; loopback if not."""
    tag = f"kvb{os.getpid()}"
    rx_ns, tx_ns = f"{tag}rx", f"{tag}tx"
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        try:
            if shutil.which("ip") is None:
                raise OSError("no `ip` command")
            for ns in (tx_ns, rx_ns):
                ip("netns", "add", ns)
                made.append(ns)
            ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
            for ns, dev, addr in (
                (tx_ns, f"{tag}a", NETNS_ADDR[0]),
                (rx_ns, f"{tag}b", NETNS_ADDR[1]),
            ):
                ip("link", "set", dev, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
            site = Site(
                "cross-host",
                tx_ns,
                rx_ns,
                NETNS_ADDR[0],
                NETNS_ADDR[1],
                f"two network namespaces over a veth pair ({NETNS_ADDR[0]} -> "
                f"{NETNS_ADDR[1]}, MTU 1500), CMA off, UCX_TLS=tcp",
            )
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            reason = err.decode(errors="replace").strip() or str(exc)
            site = Site(
                "cross-host",
                note=f"network namespaces unavailable ({reason}): "
                "loopback with CMA off, UCX_TLS=tcp",
            )
        yield site
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# ---------------------------------------------------------------------------
# Receivers (one per system) and senders, each in its own process.


def _rx_main(
    system: System, cfg: Config, site: Site, layouts: dict[str, Any], conn: Connection
) -> None:
    _enter_netns(site.rx_ns)
    os.environ.update(system.env)
    try:
        bufs = [np.zeros(cfg.pages * cfg.page_bytes, dtype=np.uint8) for _ in range(cfg.layers)]
        for b in bufs:
            b.fill(1)  # touch every page now, not during the first timed transfer
        info: dict[str, Any] = {"addrs": [int(b.ctypes.data) for b in bufs]}
        keep: Any = None
        if system.kind == "kvstate":
            from transports.ucx import UCXTransport

            keep = UCXTransport()
            keep.register_buffers(bufs, [cfg.page_bytes] * cfg.layers)
            info.update(endpoint=keep.endpoint(), layout=keep.layout())
        elif system.kind == "ucxx":
            keep = _RawUcxx(bufs)
            info.update(address=keep.address)
        elif system.kind == "nixl":
            from nixl._api import nixl_agent, nixl_agent_config

            keep = nixl_agent("rx", nixl_agent_config(backends=[]))
            keep.create_backend("UCX", {"ucx_error_handling_mode": system.nixl_error_handling})
            keep.register_memory([(int(b.ctypes.data), b.nbytes, 0, "") for b in bufs], "DRAM")
            info.update(meta=keep.get_agent_metadata())
        elif system.kind == "mooncake":
            from mooncake.engine import TransferEngine

            keep = TransferEngine()
            if keep.initialize(site.rx_addr, "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("Mooncake initialize failed")
            for b in bufs:
                keep.register_memory(int(b.ctypes.data), b.nbytes)
            info.update(target=f"{site.rx_addr}:{keep.get_rpc_port()}")
        elif system.kind == "socket":
            keep = _SocketRx(cfg, bufs, layouts, site.rx_addr)
            info.update(socket=keep.address)
        conn.send(("ok", info))
        while True:
            cmd, *args = conn.recv()
            if cmd == "reset":
                for b in bufs:
                    b.fill(0)
                if isinstance(keep, _RawUcxx):
                    keep.flat.fill(0)
                conn.send(("ok", None))
            elif cmd == "digest":
                conn.send(("ok", digests(bufs)))
            elif cmd == "rss":
                conn.send(("ok", rss_mib()))
            elif cmd == "serve":
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
        self.address = self.run(_ucxx_address(), 30)
        self.ep: Any = None

    def serve(self, seq: list[str], peer: bytes, error_handling: bool) -> bool:
        return self.run(self._serve(len(seq), peer, error_handling), 300)

    async def _serve(self, count: int, peer: bytes, error_handling: bool) -> bool:
        ucxx = self.ucxx
        if self.ep is None:  # one endpoint for the acks, kept: aborting it breaks the sender's
            self.ep = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(peer), endpoint_error_handling=error_handling
            )
        ack = np.ones(1, dtype=np.uint8)
        for _ in range(count):
            await ucxx.recv(self.flat, tag=11)
            await self.ep.send(ack, tag=12, force_tag=True)
        # Leave the bytes where the digest looks: layer by layer.
        off = 0
        for b in self.bufs:
            b[:] = self.flat[off : off + b.nbytes]
            off += b.nbytes
        return True


def _views(
    bufs: list[np.ndarray], cfg: Config, pages: np.ndarray, partner: np.ndarray
) -> list[memoryview]:
    """One memoryview per merged run and layer, in the order both sides use."""
    from transports.pages import merge_runs

    runs = merge_runs(pages, partner)
    pb = cfg.page_bytes
    return [
        memoryview(b[s * pb : (s + n) * pb].data)
        for b in bufs
        for s, n in zip(runs.src.tolist(), runs.length.tolist(), strict=True)
    ]


class _SocketRx:
    """Plain TCP receiver: scatters each transfer straight into its runs, acks with 1 byte."""

    def __init__(
        self, cfg: Config, bufs: list[np.ndarray], layouts: dict[str, Any], host: str
    ) -> None:
        # Runs keyed by destination: merge on (dst, src) so the order matches the sender's.
        self.views = {name: _views(bufs, cfg, dst, src) for name, (src, dst) in layouts.items()}
        self.listener = socket.create_server((host, 0))
        self.address = self.listener.getsockname()[:2]
        self.conn: socket.socket | None = None

    def serve(self, seq: list[str]) -> bool:
        if self.conn is None:
            self.conn, _ = self.listener.accept()
        for name in seq:
            for view in self.views[name]:
                got = 0
                while got < len(view):
                    n = self.conn.recv_into(view[got:])
                    if n == 0:
                        raise RuntimeError("socket sender went away")
                    got += n
            self.conn.sendall(b"k")
        return True


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendmsg`` up to IOV_MAX runs per call, resuming after partial sends."""
    views = list(views)
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_MAX])
        while sent and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


class _Driver:
    """Sender side of one system: ``op(case)`` moves one transfer, complete on return.

    Two-sided systems tell the receiver in ``start`` how many transfers to expect
    and collect its reply in ``finish``; one-sided ones need neither.
    """

    def __init__(self, rx_call: Callable[..., Any], rx: Connection) -> None:
        self.rx_call, self.rx = rx_call, rx
        self.ops: dict[str, Callable[[], None]] = {}
        # memcpy: the destination is in this process; verify looks here, not at the receiver
        self.local_dst: list[np.ndarray] | None = None

    def start(self, seq: list[str]) -> None:
        pass

    def finish(self) -> None:
        pass

    def op(self, case: str) -> None:
        self.ops[case]()

    def _reply(self) -> None:
        status, value = self.rx.recv()
        if status != "ok":
            raise RuntimeError(value)


def _driver(
    system: System,
    cfg: Config,
    site: Site,
    info: dict[str, Any],
    layouts: dict[str, Any],
    bufs: list[np.ndarray],
    rx_call: Callable[..., Any],
    rx: Connection,
) -> _Driver:
    drv = _Driver(rx_call, rx)
    if system.kind == "kvstate":
        from transports.base import Target
        from transports.ucx import UCXTransport

        t = UCXTransport()
        t.register_buffers(bufs, [cfg.page_bytes] * cfg.layers)
        for name, (src, dst) in layouts.items():
            targets = [Target(info["endpoint"], info["layout"], dst)]
            drv.ops[name] = functools.partial(t.write, 1, src, targets, 60.0)
    elif system.kind == "ucxx":
        import ucxx

        from transports.ucx import run_on_ucx_thread

        eh = system.key == "ucxx-eh"
        flat = np.concatenate(bufs)
        ack = np.zeros(1, dtype=np.uint8)
        me = run_on_ucx_thread(_ucxx_address(), 30)
        eps: list[Any] = []

        def start(seq: list[str]) -> None:
            rx.send(("serve", seq, me, eh))
            if not eps:  # after the receiver is serving: it connects back for the acks
                eps.append(
                    run_on_ucx_thread(
                        ucxx.create_endpoint_from_worker_address(
                            ucxx.get_ucx_address_from_buffer(info["address"]),
                            endpoint_error_handling=eh,
                        ),
                        30,
                    )
                )

        async def one() -> None:
            await eps[0].send(flat, tag=11, force_tag=True)
            await ucxx.recv(ack, tag=12)

        drv.start = start  # type: ignore[method-assign]
        drv.finish = drv._reply  # type: ignore[method-assign]
        drv.ops["one message"] = lambda: run_on_ucx_thread(one(), 60)
    elif system.kind == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("tx", nixl_agent_config(backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": system.nixl_error_handling})
        agent.register_memory([(int(b.ctypes.data), b.nbytes, 0, "") for b in bufs], "DRAM")
        peer = agent.add_remote_agent(info["meta"])
        for name, (src, dst) in layouts.items():
            local, remote = _descs(cfg, bufs, info["addrs"], src, dst)
            # Prepared once and re-posted: NIXL's best case (a real request would
            # build its descriptors each time, as kvstate's write() does).
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
                b"",
            )

            def xfer(h: Any = h) -> None:
                state = agent.transfer(h)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(h)
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")

            drv.ops[name] = xfer
    elif system.kind == "mooncake":
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        if te.initialize(site.tx_addr, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        for b in bufs:
            te.register_memory(int(b.ctypes.data), b.nbytes)
        for name, (src, dst) in layouts.items():
            local, remote = _descs(cfg, bufs, info["addrs"], src, dst)
            la, ra, ln = local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()

            def mc(la: list[int] = la, ra: list[int] = ra, ln: list[int] = ln) -> None:
                if te.batch_transfer_sync_write(info["target"], la, ra, ln) != 0:
                    raise RuntimeError("Mooncake transfer failed")

            drv.ops[name] = mc
    elif system.kind == "memcpy":
        drv.local_dst = [np.ones_like(b) for b in bufs]
        drv.ops.update(_copy_ops(cfg, layouts, bufs, drv.local_dst))
    elif system.kind == "socket":
        views = {name: _views(bufs, cfg, src, dst) for name, (src, dst) in layouts.items()}
        sock = socket.create_connection(tuple(info["socket"]), timeout=60)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send(views: list[memoryview]) -> None:
            _send_views(sock, views)
            if sock.recv(1) != b"k":
                raise RuntimeError("socket receiver went away")

        drv.start = lambda seq: rx.send(("serve", seq))  # type: ignore[method-assign]
        drv.finish = drv._reply  # type: ignore[method-assign]
        for name in layouts:
            drv.ops[name] = functools.partial(send, views[name])
    return drv


def _tx_main(
    system: System,
    cfg: Config,
    site: Site,
    info: dict[str, Any],
    layouts: dict[str, Any],
    conn: Connection,
    rx: Connection,
) -> None:
    """Sender: on ``rep``, one timed transfer of every case (layouts alternating); on
    ``verify``, one more transfer per case into zeroed pages, then the digests."""
    _enter_netns(site.tx_ns)
    os.environ.update(system.env)
    try:
        bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]

        def rx_call(*msg: Any) -> Any:
            rx.send(msg)
            status, value = rx.recv()
            if status != "ok":
                raise RuntimeError(value)
            return value

        drv = _driver(system, cfg, site, info, layouts, bufs, rx_call, rx)
        cases = list(drv.ops)
        rx_call("reset")
        conn.send(("ok", cases))
        while True:
            cmd = conn.recv()
            if cmd == "rep":
                times = {}
                drv.start(cases)
                for case in cases:
                    t0 = time.perf_counter()
                    drv.op(case)
                    times[case] = time.perf_counter() - t0
                drv.finish()
                conn.send(("ok", times))
            elif cmd == "verify":
                results: dict[str, Any] = {}
                for case in cases:  # outside the timed part
                    rx_call("reset")
                    for b in drv.local_dst or []:
                        b.fill(0)
                    drv.start([case])
                    drv.op(case)
                    drv.finish()
                    src, dst = layouts.get(case) or (np.arange(cfg.pages),) * 2
                    got = digests(drv.local_dst) if drv.local_dst else rx_call("digest")
                    ok = got == expected_digests(cfg, src, dst)
                    results[case] = {
                        "verified": ok,
                        "rss_mib": {"tx": rss_mib(), "rx": rx_call("rss")},
                    }
                conn.send(("ok", results))
            else:
                conn.send(("ok", None))
                return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def rss_mib() -> float:
    """This process's resident memory (VmRSS), for the cost of UCX's buffers."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _ucxx_address() -> bytes:
    import ucxx

    return bytes(ucxx.get_worker_address())


def _descs(
    cfg: Config, bufs: list[np.ndarray], remote_addrs: list[int], src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
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


class Pair:
    """A system's receiver and sender processes, driven one rep at a time."""

    def __init__(self, system: System, cfg: Config, site: Site, layouts: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.system = system
        self.rx, rx_end = ctx.Pipe()
        self.procs = [
            ctx.Process(target=_rx_main, args=(system, cfg, site, layouts, rx_end), daemon=True)
        ]
        self.procs[0].start()
        try:
            info = self._reply(self.rx, 120, "receiver did not start")
            self.tx, tx_end = ctx.Pipe()
            self.procs.append(
                ctx.Process(
                    target=_tx_main,
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


def _copy_ops(
    cfg: Config, layouts: dict[str, Any], srcs: list[np.ndarray], dsts: list[np.ndarray]
) -> dict[str, Callable[[], None]]:
    """Per layout, an in-process copy of its merged runs from ``srcs`` into ``dsts``: the
    memcpy row timed in turn and the baseline timed alone copy the same way."""
    from transports.pages import merge_runs

    pb = cfg.page_bytes
    ops: dict[str, Callable[[], None]] = {}
    for name, (src, dst) in layouts.items():
        runs = merge_runs(src, dst)
        spans = list(
            zip(
                (runs.src * pb).tolist(),
                (runs.dst * pb).tolist(),
                (runs.length * pb).tolist(),
                strict=True,
            )
        )

        def copy(spans: list[tuple[int, int, int]] = spans) -> None:
            for s, d in zip(srcs, dsts, strict=True):
                for so, do, n in spans:
                    d[do : do + n] = s[so : so + n]

        ops[name] = copy
    return ops


def memcpy_baseline(cfg: Config, layouts: dict[str, Any]) -> dict[str, Any]:
    """In-process copies of the same runs, in this process after every pair is done: the
    old ceiling, kept beside the memcpy row timed in turn (it was 1.6-2.3x faster here,
    never following another system's transfer)."""
    src_bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]
    ops = _copy_ops(cfg, layouts, src_bufs, [np.ones_like(b) for b in src_bufs])
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(cfg.warmup + cfg.reps):
        for name, op in ops.items():
            t0 = time.perf_counter()
            op()
            if rep >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: {"times": t, "verified": None} for name, t in times.items()}


def available(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def row(mode: str, system: System, case: str, nbytes: int, r: dict[str, Any]) -> dict[str, Any]:
    t = r["times"]
    return {
        "mode": mode,
        "system": system.key,
        "label": system.label,
        "path": system.path,
        "family": system.family,
        "settings": system.settings(),
        "case": case,
        "gbps": round(nbytes / statistics.median(t) / 1e9, 3),
        "gbps_min": round(nbytes / max(t) / 1e9, 3),
        "gbps_max": round(nbytes / min(t) / 1e9, 3),
        "median_ms": round(statistics.median(t) * 1e3, 2),
        "reps": len(t),
        "verified": r.get("verified"),
        "rss_mib": r.get("rss_mib"),
    }


def run_mode(
    mode: str,
    cfg: Config,
    layouts: dict[str, Any],
    skip: set[str],
    lanes: list[int],
    extras: tuple[tuple[str, dict[str, str]], ...],
    say: Callable[[str], None],
    notes: list[str],
) -> list[dict[str, Any]]:
    """Start every system's pair, then time them rep by rep in turn (so a burst of load
    from elsewhere hits all of them alike), then verify each."""
    rows: list[dict[str, Any]] = []
    site_cm = (
        cross_host_site()
        if mode == "cross-host"
        else contextlib.nullcontext(Site("same-host", note="one host, loopback / shared memory"))
    )
    with site_cm as site, contextlib.ExitStack() as stack:
        say(f"[{mode}] {site.note}")
        notes.append(f"{mode}: {site.note}")
        pairs: list[Pair] = []
        for system in systems(mode, lanes, extras):
            if system.key in skip or system.kind in skip or system.family in skip:
                notes.append(f"{mode}: {system.label}: skipped (--skip)")
                continue
            if system.module and not available(system.module):
                notes.append(
                    f"{mode}: {system.label}: not installed ({INSTALL[system.module]}; "
                    "docs/development.md)"
                )
                continue
            say(f"[{mode}] starting {system.label} ...")
            try:
                pairs.append(Pair(system, cfg, site, layouts))
            except Exception as exc:
                notes.append(f"{mode}: {system.label}: failed: {str(exc).splitlines()[0]}")
                continue
            stack.callback(pairs[-1].close)
            pairs[-1].pause(True)
        times: dict[str, dict[str, list[float]]] = {p.system.key: {} for p in pairs}
        say(f"[{mode}] {cfg.warmup} warm-up and {cfg.reps} timed reps, systems in turn ...")
        order = random.Random(7)
        for rep in range(cfg.warmup + cfg.reps):
            # A fresh order every rep: what ran just before a system slows it (a socket
            # transfer cut the next in-process memcpy by up to 40% here), so no system
            # may always follow the same one.
            turn = list(pairs)
            order.shuffle(turn)
            for pair in turn:
                try:
                    pair.pause(False)
                    got = pair.call("rep")
                    pair.pause(True)
                except Exception as exc:
                    notes.append(f"{mode}: {pair.system.label}: failed: {str(exc).splitlines()[0]}")
                    pairs.remove(pair)
                    continue
                if rep >= cfg.warmup:
                    for case, t in got.items():
                        times[pair.system.key].setdefault(case, []).append(t)
        for pair in pairs:
            try:
                pair.pause(False)
                checks = pair.call("verify")
                pair.pause(True)
            except Exception as exc:
                notes.append(f"{mode}: {pair.system.label}: failed: {str(exc).splitlines()[0]}")
                continue
            for case, check in checks.items():
                r = {"times": times[pair.system.key][case]} | check
                rows.append(row(mode, pair.system, case, cfg.total_bytes, r))
                if not check["verified"]:
                    notes.append(f"{mode}: {pair.system.label}/{case}: receiver bytes differ")
    if mode == "same-host" and "memcpy" not in skip:
        alone = System(
            "memcpy-alone",
            "numpy memcpy in the main process, after the run (not in turn)",
            "memcpy",
            family="memcpy-alone",
        )
        rows += [
            row(mode, alone, case, cfg.total_bytes, r)
            for case, r in memcpy_baseline(cfg, layouts).items()
        ]
    return rows


def best_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, case and peer family: the fastest setting's row key and median GB/s."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if not r["family"]:
            continue
        key = f"{r['mode']} {r['case']} {r['family']}"
        if key not in out or r["gbps"] > out[key]["gbps"]:
            out[key] = {"system": r["system"], "label": r["label"], "gbps": r["gbps"]}
    return out


def ratios_of(
    rows: list[dict[str, Any]],
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """The targets (issues 13 and 22) as ratios of medians in this run, against each
    peer's best setting; and kvstate's ratio to every other row, setting by setting."""
    best = best_of(rows)

    def kv(mode: str, system: str, case: str) -> float | None:
        hits = [
            float(r["gbps"])
            for r in rows
            if r["mode"] == mode and r["system"] == system and r["case"] == case
        ]
        return hits[0] if hits else None

    def peer(mode: str, family: str, case: str) -> float | None:
        hit = best.get(f"{mode} {case} {family}") or best.get(f"{mode} one message {family}")
        return float(hit["gbps"]) if hit else None

    out: dict[str, float | None] = {}

    def ratio(key: str, a: float | None, b: float | None) -> None:
        out[key] = round(a / b, 3) if a and b else None

    targets = (
        ("nixl", "NIXL (best setting)", "[>= 1.0]"),
        ("mooncake", "Mooncake (best lane count)", "[>= 1.0]"),
        ("ucxx", "raw ucxx one message", "[>= 0.8]"),
        ("socket", "plain socket", ""),
    )
    for case in ("contiguous", "fragmented"):
        x = kv("cross-host", "kvstate-ucx", case)
        if x is not None:
            for family, name, bound in targets:
                ratio(
                    f"cross-host {case}: kvstate UCX / {name}  {bound}".rstrip(),
                    x,
                    peer("cross-host", family, case),
                )
        x = kv("same-host", "kvstate-cma", case)
        if x is not None:
            ratio(
                f"same host {case}: kvstate CMA / memcpy (timed in turn)  [>= 0.9]",
                x,
                peer("same-host", "memcpy", case),
            )
            ratio(
                f"same host {case}: kvstate CMA / memcpy alone after the run",
                x,
                peer("same-host", "memcpy-alone", case),
            )
            for family, name, bound in targets:
                bound = {"ucxx": "[>= 0.9]", "mooncake": "[>= 1.0]"}.get(family, bound)
                ratio(
                    f"same host {case}: kvstate CMA / {name}  {bound}".rstrip(),
                    x,
                    peer("same-host", family, case),
                )
            ratio(
                f"same host {case}: kvstate UCX path / NIXL (best setting)",
                kv("same-host", "kvstate-ucx", case),
                peer("same-host", "nixl", case),
            )
    each: dict[str, float | None] = {}
    for r in rows:
        if not r["family"]:
            continue
        mine = "kvstate-ucx" if r["mode"] == "cross-host" else "kvstate-cma"
        for case in ("contiguous", "fragmented"):
            if r["case"] not in (case, "one message"):
                continue
            x = kv(r["mode"], mine, case)
            key = f"{r['mode']} {case}: {mine} / {r['system']}"
            each[key] = round(x / r["gbps"], 3) if x and r["gbps"] else None
    return out, each


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument(
        "--cross-host",
        action="store_true",
        help="sender and receiver in two network namespaces over a veth pair",
    )
    ap.add_argument(
        "--plot", metavar="PNG", help="run same-host and cross-host and draw both (matplotlib)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=1024, help="pages per layer")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument(
        "--mooncake-lanes",
        default="1,2,4,8,16",
        help="comma list of MC_TCP_LANES_PER_PEER values: one Mooncake row each",
    )
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE,...",
        help="one more kvstate row with these environment variables, timed in turn with "
        "the rest (UCX path; KVSTATE_UCX_CMA=1 makes it a same-host CMA row), e.g. "
        "chunk0:KVSTATE_UCX_PUT_CHUNK=0; repeatable",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of systems or kinds: kvstate-cma,kvstate-ucx,ucxx,ucxx-eh,nixl,"
        "nixl-eh,nixl-seg,nixl-eh-seg,mooncake,mooncake-N,socket,memcpy",
    )
    args = ap.parse_args(argv)
    lanes = [int(x) for x in args.mooncake_lanes.split(",") if x.strip()]
    extras = []
    for spec in args.extra:
        name, _, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if "=" in a)
        if not name or not env:
            ap.error(f"--extra {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
        extras.append((name, env))
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = sys.stdout
    if args.json:
        # Peers' C libraries (and their Python wrappers) log to stdout: send every write to
        # fd 1, ours and the spawned processes', to stderr and keep stdout for the document.
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    cfg = Config(args.layers, args.pages, args.page_kib * 1024, args.reps)
    skip = set(filter(None, args.skip.split(",")))
    say: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print

    ident = np.arange(cfg.pages, dtype=np.int32)
    layouts = {"contiguous": (ident, ident), "fragmented": runs_layout(cfg.pages, 1, 8, 42)}
    from transports.pages import merge_runs

    frag_runs = len(merge_runs(*layouts["fragmented"]).length)
    load0 = os.getloadavg()
    say(
        f"{cfg.layers} layers x {cfg.pages} pages x {cfg.page_bytes // 1024} KiB = "
        f"{cfg.total_bytes / 2**20:.0f} MiB; fragmented: {frag_runs} runs per layer "
        f"({frag_runs * cfg.layers} in all); host {socket.gethostname()}, "
        f"{os.cpu_count()} CPUs, load {load0[0]:.2f}; median of {cfg.reps} after "
        f"{cfg.warmup} warm-up"
    )
    modes = (
        ["same-host", "cross-host"]
        if args.plot
        else ["cross-host"]
        if args.cross_host
        else ["same-host"]
    )
    started = time.perf_counter()
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for mode in modes:
        rows += run_mode(mode, cfg, layouts, skip, lanes, tuple(extras), say, notes)
    ratios, ratios_each = ratios_of(rows)
    load1 = os.getloadavg()
    if args.plot:
        notes.append(plot(rows, cfg, args.plot, load1[0]))
    doc = {
        "config": asdict(cfg)
        | {"total_bytes": cfg.total_bytes, "fragmented_runs_per_layer": frag_runs},
        "modes": modes,
        "results": rows,
        "ratios": ratios,
        "best": best_of(rows),
        "ratios_each_setting": ratios_each,
        "notes": notes,
        "loadavg": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        out.write(json.dumps(doc, indent=2) + "\n")
        out.flush()
    else:
        print(
            f"\n{'mode':<11}{'system':<16}{'path':<5}{'case':<12}{'GB/s':>7}  "
            f"{'spread':<13}{'ms':>8}  verified"
        )
        for r in rows:
            spread = f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}"
            print(
                f"{r['mode']:<11}{r['system']:<16}{r['path']:<5}{r['case']:<12}"
                f"{r['gbps']:>7.2f}  {spread:<13}{r['median_ms']:>8.2f}  {r['verified']}"
            )
        print("\nratios of medians (each peer at its best setting in this run):")
        for key, val in ratios.items():
            print(f"  {key:<72} {'n/a' if val is None else f'{val:.2f}'}")
        for key, hit in best_of(rows).items():
            print(f"  best {key}: {hit['system']} ({hit['gbps']:.2f} GB/s)")
        for note in notes:
            print(f"note: {note}")
        print(
            f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; "
            f"wall time {doc['wall_s']} s"
        )
    return 0 if all(r["verified"] in (True, None) for r in rows) else 1


def plot(rows: list[dict[str, Any]], cfg: Config, path: str, load: float) -> str:
    """Horizontal bars, one row per system and path, both layouts, x from 0, spread bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install matplotlib)"
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["mode"], r["system"]) not in keys:
            keys.append((r["mode"], r["system"]))
    label = {(r["mode"], r["system"]): r["label"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(keys) + 1.8))
    height = 0.38
    for j, (case, color) in enumerate((("contiguous", "tab:blue"), ("fragmented", "tab:orange"))):
        ys, vals, lo, hi = [], [], [], []
        for i, key in enumerate(keys):
            hit = [
                r
                for r in rows
                if (r["mode"], r["system"]) == key and r["case"] in (case, "one message")
            ]
            if not hit or (hit[0]["case"] == "one message" and case == "fragmented"):
                continue
            r = hit[0]
            ys.append(i + (j - 0.5) * height)
            vals.append(r["gbps"])
            lo.append(r["gbps"] - r["gbps_min"])
            hi.append(r["gbps_max"] - r["gbps"])
        ax.barh(
            ys,
            vals,
            height,
            xerr=[lo, hi],
            color=color,
            capsize=2,
            label=f"{case} (one message for raw ucxx)"
            if j == 0
            else "fragmented: runs of 1-8 pages",
        )
    names = []
    for mode, system in keys:
        where = "1 host" if mode == "same-host" else "2 netns/TCP"
        bold = system.startswith("kvstate")
        names.append(("\u25b6 " if bold else "") + f"[{where}] {label[(mode, system)]}")
    ax.set_yticks(range(len(keys)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("GB/s (median of the reps; bars: slowest..fastest rep)")
    fig.suptitle(  # centred on the figure: the long row labels push the axes right
        f"KV pages: {cfg.layers} layers x {cfg.pages} pages x {cfg.page_bytes // 1024} KiB "
        f"= {cfg.total_bytes / 2**20:.0f} MiB, contiguous and fragmented\n"
        "kvstate (\u25b6): CMA path on 1 host, UCX put path across 2 network namespaces "
        "(TCP)\nvs NIXL and Mooncake (every setting: one row each), raw ucxx, plain socket, "
        f"memcpy;\n{cfg.reps} reps each, in turn, load {load:.1f} on {os.cpu_count()} CPUs",
        fontsize=9,
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"


if __name__ == "__main__":
    sys.exit(main())
