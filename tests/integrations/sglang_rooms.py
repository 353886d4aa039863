"""Rooms over time on SGLang's own classes, for test_sglang_rooms.py (issue 29, item 6):
a prefill's pages for a decode that never comes are freed at the bootstrap timeout, a
decode holding the request in its queue keeps them as long as it polls. Runs in a
spawned process (SGLang's imports), with a short bootstrap timeout and hold."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tests.integrations.rig import ADDR, Rank, room_plan, sglang

BOOTSTRAP = 1.5  # s: the prefill's bootstrap timeout in this scenario
HOLD = 1.0  # s: each hold the decode renews (every HOLD / 4)


def holds(url: str, out: str) -> None:
    os.environ["KVSTATE_REDIS_URL"] = url
    os.environ["KVSTATE_SGLANG_BOOTSTRAP_TIMEOUT"] = str(BOOTSTRAP)
    os.environ["KVSTATE_SGLANG_HOLD"] = str(HOLD)
    os.environ.pop("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", None)
    sg = sglang()
    KVPoll = sg.KVPoll
    p = Rank(sg, "prefill", 0, 1, seed=3).start()
    d = Rank(sg, "decode", 0, 1, seed=None).start()
    assert d.mgr.try_ensure_parallel_info(ADDR)
    res: dict[str, Any] = {"bootstrap_timeout": p.mgr.kv.bootstrap_timeout}

    def until_failed(tx: Any, limit: float) -> tuple[float, str]:
        t0 = time.monotonic()
        while tx.poll() != KVPoll.Failed and time.monotonic() - t0 < limit:
            time.sleep(0.05)
        try:
            tx.failure_exception()
        except Exception as exc:  # SGLang's KVTransferError
            return time.monotonic() - t0, str(exc)
        return time.monotonic() - t0, ""

    # 1. no decode ever joins: the prefill's room fails at its bootstrap timeout
    lone = sg.cls("sender")(p.mgr, ADDR, room_plan(0, 9300)["room"])
    res["never_joined"] = until_failed(lone, 30 * BOOTSTRAP)[1]
    # 2. a decode binds and keeps the request queued (no pages published) while it
    # polls, for 4 bootstrap timeouts: the prefill still waits for it
    pl = room_plan(1, 9300)
    tx = sg.cls("sender")(p.mgr, ADDR, pl["room"])
    rx = sg.cls("receiver")(d.mgr, ADDR, pl["room"])
    rx.init(0)
    t0, seen = time.monotonic(), set()
    while time.monotonic() - t0 < 4 * BOOTSTRAP:
        seen.add(int(rx.poll()))
        seen.add(int(tx.poll()))
        time.sleep(0.05)
    res["held"] = sorted(seen)
    res["holds"] = d.mgr.holds
    # 3. then it publishes: the transfer goes through as if it had come at once
    rx.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
    t0 = time.monotonic()
    while tx.poll() not in (KVPoll.WaitingForInput, KVPoll.Failed) and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    tx.init(len(pl["src"]), pl["aux_src"])
    tx.send(pl["src"], [pl["state_src"]])
    while rx.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    res["after_hold"] = [int(tx.poll()), int(rx.poll())]
    res["bytes_equal"] = all(
        p.pages(layer, pl["src"]) == d.pages(layer, pl["dst"]) for layer in range(4)
    )
    tx.clear()
    rx.clear()
    # 4. a decode that holds a request and then stops (it dropped the request, or
    # died): the prefill frees the pages one bootstrap timeout after the last hold
    pl = room_plan(2, 9300)
    tx = sg.cls("sender")(p.mgr, ADDR, pl["room"])
    rx = sg.cls("receiver")(d.mgr, ADDR, pl["room"])
    rx.init(0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2 * BOOTSTRAP:
        rx.poll()
        tx.poll()
        time.sleep(0.05)
    # the decode stops polling the request, hence holding it (its lease is another matter)
    res["stopped"] = until_failed(tx, 30 * BOOTSTRAP)[1]
    rx.clear()
    d.mgr.close()
    p.mgr.close()
    Path(out, "holds.json").write_text(json.dumps(res))
