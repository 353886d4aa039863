"""Load: the demo at 2000 requests on 2 prefill + 2 decode workers, and room memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvstate
from tests.helpers import PREFILL_ADDR, managers, scaled


@pytest.mark.slow
def test_demo_2000_requests_on_two_by_two_workers(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstate.demo",
            "--url",
            redis_url,
            "--requests",
            "2000",
            "--prefill-workers",
            "2",
            "--decode-workers",
            "2",
            "--pages-per-request",
            "1-16",
            "--page-bytes",
            "4k",
            "--abort-rate",
            "0.02",
            "--seed",
            "11",
            "--lease",
            "30",
            "--timeout",
            "120",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(900),
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    # Under load on 2 cores a room may time out: that is allowed, as long as it ends
    # Failed with a reason (the demo's own exit status is stricter: injected faults only).
    assert summary["all_success_verified"]
    assert len(summary["rooms"]) == 2000
    for room in summary["rooms"]:  # every room done, or Failed with a reason
        assert room["decode_status"] in ("Success", "Failed"), room
        if room["decode_status"] == "Failed":
            assert room["decode_reason"], room
    assert summary["outcomes"]["done"] > 1800
    assert summary["keys_left"] == 0, summary["keys_left_sample"]
    assert summary["bytes_verified"] > 0
    print("2000 rooms:", summary["outcomes"], summary["latency_ms"], summary["gb_per_s"], "GB/s")


def test_memory_per_in_flight_room_is_under_1_kib(redis_url: str) -> None:
    """docs/design.md, Targets: a 4096-page contiguous request, both sides created and published."""
    store = kvstate.connect(redis_url, namespace="mem")
    p, d = managers(store)
    with p, d:
        parts = []
        for room in range(100):
            rcv = d.receiver(room, PREFILL_ADDR)
            rcv.init(np.arange(room * 4096, (room + 1) * 4096))
            snd = p.sender(room)
            snd.poll()
            snd.begin_transfer()
            parts.append((snd, rcv))
        c = store.client
        total = sum(
            int(c.memory_usage(k, samples=0))
            for r in range(100)
            for k in store.scan(store.keys.room_prefix(r) + "*")
        )
        per_room = total / 100
        print(f"Redis memory per in-flight room: {per_room:.0f} bytes")
        assert per_room <= 1024
        for snd, rcv in parts:
            snd.clear()
            rcv.clear()
    store.close()
