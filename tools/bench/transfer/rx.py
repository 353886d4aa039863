"""The receiver process of every system: registers its pages, then answers the sender
(reset, serve, digest, rss, stop) over a pipe."""

from __future__ import annotations

import os
import socket
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tools.bench.transfer.runs import views
from tools.bench.transfer.sites import Site, enter_netns
from tools.bench.transfer.systems import System
from tools.bench.transfer.workload import Config, digests, rss_mib


def rx_main(
    system: System, cfg: Config, site: Site, layouts: dict[str, Any], conn: Connection
) -> None:
    enter_netns(site.rx_ns)
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
            keep = RawUcxxRx(bufs)
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
            keep = SocketRx(cfg, bufs, layouts, site.rx_addr)
            info.update(socket=keep.address)
        conn.send(("ok", info))
        while True:
            cmd, *args = conn.recv()
            if cmd == "reset":
                for b in bufs:
                    b.fill(0)
                if isinstance(keep, RawUcxxRx):
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


async def ucxx_address() -> bytes:
    import ucxx

    return bytes(ucxx.get_worker_address())


class RawUcxxRx:
    """One message of all bytes, as plain ucxx would send it (receiver side)."""

    def __init__(self, bufs: list[np.ndarray]) -> None:
        from transports.ucx import run_on_ucx_thread

        self.run = run_on_ucx_thread
        self.bufs = bufs
        self.flat = np.zeros(sum(b.nbytes for b in bufs), dtype=np.uint8)
        self.flat.fill(1)
        import ucxx

        self.ucxx = ucxx
        self.address = self.run(ucxx_address(), 30)
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


class SocketRx:
    """Plain TCP receiver: scatters each transfer straight into its runs, acks with 1 byte."""

    def __init__(
        self, cfg: Config, bufs: list[np.ndarray], layouts: dict[str, Any], host: str
    ) -> None:
        # Runs keyed by destination: merge on (dst, src) so the order matches the sender's.
        self.views = {name: views(bufs, cfg, dst, src) for name, (src, dst) in layouts.items()}
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
