"""The sender process: times each rep's transfers, then verifies the receiver's bytes."""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tools.bench.transfer.drivers import driver
from tools.bench.transfer.sites import Site, enter_netns
from tools.bench.transfer.systems import System
from tools.bench.transfer.workload import Config, digests, expected_digests, rss_mib, sender_layer


def tx_main(
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
    enter_netns(site.tx_ns)
    os.environ.update(system.env)
    try:
        bufs = [sender_layer(cfg, i) for i in range(cfg.layers)]

        def rx_call(*msg: Any) -> Any:
            rx.send(msg)
            status, value = rx.recv()
            if status != "ok":
                raise RuntimeError(value)
            return value

        drv = driver(system, cfg, site, info, layouts, bufs, rx_call, rx)
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
