"""The sender side of each system: one callable per case that moves one transfer."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tools.bench.transfer.runs import copy_ops, descs, views
from tools.bench.transfer.rx import ucxx_address
from tools.bench.transfer.sites import Site
from tools.bench.transfer.systems import System
from tools.bench.transfer.workload import Config

IOV_MAX = 1024


def nixl_write(agent: Any, handle: Any) -> None:
    """Post one prepared NIXL transfer and spin until it is done (a failure raises)."""
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    if state == "ERR":
        raise RuntimeError("NIXL transfer failed")


def send_views(sock: socket.socket, parts: list[memoryview]) -> None:
    """``sendmsg`` up to IOV_MAX runs per call, resuming after partial sends."""
    parts = list(parts)
    i = 0
    while i < len(parts):
        sent = sock.sendmsg(parts[i : i + IOV_MAX])
        while sent and sent >= len(parts[i]):
            sent -= len(parts[i])
            i += 1
        if sent:
            parts[i] = parts[i][sent:]


class Driver:
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

    def reply(self) -> None:
        """The receiver's answer to ``serve``: raises what went wrong there."""
        status, value = self.rx.recv()
        if status != "ok":
            raise RuntimeError(value)


def driver(
    system: System,
    cfg: Config,
    site: Site,
    info: dict[str, Any],
    layouts: dict[str, Any],
    bufs: list[np.ndarray],
    rx_call: Callable[..., Any],
    rx: Connection,
) -> Driver:
    drv = Driver(rx_call, rx)
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
        me = run_on_ucx_thread(ucxx_address(), 30)
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
        drv.finish = drv.reply  # type: ignore[method-assign]
        drv.ops["one message"] = lambda: run_on_ucx_thread(one(), 60)
    elif system.kind == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("tx", nixl_agent_config(backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": system.nixl_error_handling})
        agent.register_memory([(int(b.ctypes.data), b.nbytes, 0, "") for b in bufs], "DRAM")
        peer = agent.add_remote_agent(info["meta"])
        for name, (src, dst) in layouts.items():
            local, remote = descs(cfg, bufs, info["addrs"], src, dst)
            # Prepared once and re-posted: NIXL's best case (a real request would
            # build its descriptors each time, as kvstate's write() does).
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
                b"",
            )

            drv.ops[name] = functools.partial(nixl_write, agent, h)
    elif system.kind == "mooncake":
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        if te.initialize(site.tx_addr, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        for b in bufs:
            te.register_memory(int(b.ctypes.data), b.nbytes)
        for name, (src, dst) in layouts.items():
            local, remote = descs(cfg, bufs, info["addrs"], src, dst)
            la, ra, ln = local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()

            def mc(la: list[int] = la, ra: list[int] = ra, ln: list[int] = ln) -> None:
                if te.batch_transfer_sync_write(info["target"], la, ra, ln) != 0:
                    raise RuntimeError("Mooncake transfer failed")

            drv.ops[name] = mc
    elif system.kind == "memcpy":
        drv.local_dst = [np.ones_like(b) for b in bufs]
        drv.ops.update(copy_ops(cfg, layouts, bufs, drv.local_dst))
    elif system.kind == "socket":
        sent = {name: views(bufs, cfg, src, dst) for name, (src, dst) in layouts.items()}
        sock = socket.create_connection(tuple(info["socket"]), timeout=60)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send(parts: list[memoryview]) -> None:
            send_views(sock, parts)
            if sock.recv(1) != b"k":
                raise RuntimeError("socket receiver went away")

        drv.start = lambda seq: rx.send(("serve", seq))  # type: ignore[method-assign]
        drv.finish = drv.reply  # type: ignore[method-assign]
        for name in layouts:
            drv.ops[name] = functools.partial(send, sent[name])
    return drv
