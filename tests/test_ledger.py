"""The leak ledger: participants reaped by TTL are recorded with their last status,
whether expiry notifications are available or not; cleared ones are not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import kvstate
from kvstate.ops.ledger import LEDGER_TTL_MS, Entry, Ledger
from kvstate.ops.metrics import Metrics
from kvstate.ops.monitor import Monitor
from kvstate.poll import KVPoll
from kvstate.store import Store
from kvstate.testing.process import free_port
from tests.helpers import scaled, wait_for

ADDR = "10.0.0.1:8998"
KVSTATE_BIN = Path(sys.executable).with_name("kvstate")


def short_lived(url: str, ttl: float = 1.0) -> Store:
    return kvstate.connect(url, room_ttl=ttl)


def make_room(url: str, room: int, ttl: float = 1.0) -> tuple[Store, list[kvstate.KVManager]]:
    """A sender and a receiver in WaitingForInput that nobody will ever clear."""
    s = short_lived(url, ttl)
    p = kvstate.KVManager(s, "prefill", "prefill-a", ADDR)
    d = kvstate.KVManager(s, "decode", "decode-b")
    snd, rcv = p.sender(room), d.receiver(room, ADDR)
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    return s, [p, d]


def expire_now(store: Store, key: str) -> None:
    """Touch a key past its TTL so the server deletes it (and fires the event) now."""
    assert wait_for(lambda: store.client.exists(key) == 0, 5.0)


def test_ledger_append_and_recent(store: Store) -> None:
    led = Ledger(store)
    led.append(
        [
            Entry("expired", 7, "tx", "e1", "Bootstrapping", 1200, "k1", "d"),
            Entry("audit:stuck", None, "", "", "", None, "k2"),
        ]
    )
    got = led.recent(5)
    assert [e.event for e in got] == ["audit:stuck", "expired"]
    assert got[1].room == 7 and got[1].age_ms == 1200 and got[1].status == "Bootstrapping"
    assert got[0].room is None and got[0].at_ms is not None
    ttl = store.client.pttl(store.keys.ledger)
    assert LEDGER_TTL_MS - 60_000 < ttl <= LEDGER_TTL_MS


def test_expiry_event_records_last_status(store: Store, state_url: str) -> None:
    s, mgrs = make_room(state_url, 21)
    mon = Monitor(store, interval=0.1)
    assert "notifications on" in mon.start()
    mon.sweep()
    assert len(mon.known) == 2
    keys = list(mon.known)
    for key in keys:
        expire_now(store, key)
    entries: list[Entry] = []
    assert wait_for(lambda: bool(entries.extend(mon.sweep())) or len(entries) >= 2, 5.0)
    assert sorted((e.side, e.status) for e in entries) == [
        ("rx", "WaitingForInput"),
        ("tx", "WaitingForInput"),
    ]
    assert all(e.room == 21 and e.age_ms is not None and e.age_ms >= 900 for e in entries)
    assert {e.key for e in Ledger(store).recent(10)} == set(keys)
    for m in mgrs:
        m.close()
    s.close()
    mon.events.close()


def test_cleared_participants_are_not_recorded(store: Store, state_url: str) -> None:
    mon = Monitor(store, interval=0.1)
    mon.start()
    with kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p:
        snd = p.sender(22)
        snd.poll()
        mon.sweep()
        snd.clear()
    assert mon.sweep() == []
    assert mon.sweep() == []  # held one sweep for a late event, then forgotten
    assert mon.known == {} and mon._gone == {}
    assert Ledger(store).recent(5) == []
    mon.events.close()


def test_created_and_expired_between_sweeps_is_unknown(store: Store, state_url: str) -> None:
    mon = Monitor(store, interval=0.1)
    mon.start()
    mon.sweep()
    s = short_lived(state_url, 0.3)
    with kvstate.KVManager(s, "prefill", "prefill-a", ADDR) as p:
        p.sender(23).poll()
        key = s.keys.participant(23, "tx", "prefill-a")
        expire_now(store, key)
    entries: list[Entry] = []
    assert wait_for(lambda: bool(entries.extend(mon.sweep())) or bool(entries), 5.0)
    assert [(e.room, e.side, e.engine, e.status) for e in entries] == [
        (23, "tx", "prefill-a", "unknown")
    ]
    s.close()
    mon.events.close()


def test_without_notifications_the_deadline_rule_applies(redis_url: str) -> None:
    """CONFIG denied or --no-notify on a server without Ex: a participant that vanished
    at its TTL deadline is reaped, one cleared well before it is not."""
    store = kvstate.connect(redis_url)
    store.client.config_set("notify-keyspace-events", "")
    mon = Monitor(store, interval=0.1, notifications=False)
    assert "not changing" in mon.start()
    s, mgrs = make_room(redis_url, 24)
    with kvstate.KVManager(store, "prefill", "prefill-c", "10.0.0.3:1") as p:
        cleared = p.sender(25)
        cleared.poll()
        mon.sweep()
        cleared.clear()
        assert mon.sweep() == []
    entries: list[Entry] = []
    assert wait_for(lambda: bool(entries.extend(mon.sweep())) or len(entries) >= 2, 5.0)
    assert sorted((e.room, e.side, e.status) for e in entries) == [
        (24, "rx", "WaitingForInput"),
        (24, "tx", "WaitingForInput"),
    ]
    assert all("deadline" in e.detail for e in entries)
    for m in mgrs:
        m.close()
    s.close()
    store.close()


@pytest.mark.parametrize("enable", [True, False], ids=["notify", "no-notify"])
def test_notifications_turned_off_mid_run(redis_url: str, enable: bool) -> None:
    """The monitor started with expiry events; an operator (or a restart) turns them
    off. The subscription stays open but silent: participants that vanished at their
    deadline meanwhile are still recorded, by the deadline rule, including one held a
    sweep for its event when they went off; with --notify the monitor turns them back
    on, with --no-notify it leaves them off."""
    store = kvstate.connect(redis_url)
    store.client.config_set("notify-keyspace-events", "Ex")
    mon = Monitor(store, interval=0.1, notifications=enable)
    assert "notifications on" in mon.start()
    s, mgrs = make_room(redis_url, 26)
    mon.sweep()
    held_key = next(k for k in mon.known if ":tx:" in k)
    store.client.config_set("notify-keyspace-events", "")
    for key in list(mon.known):
        expire_now(store, key)
    entries: list[Entry] = []
    assert wait_for(lambda: bool(entries.extend(mon.sweep())) or len(entries) >= 2, 5.0)
    assert sorted((e.room, e.side, e.status) for e in entries) == [
        (26, "rx", "WaitingForInput"),
        (26, "tx", "WaitingForInput"),
    ]
    assert all("deadline" in e.detail for e in entries), entries
    assert {e.key for e in Ledger(store).recent(10)} >= {held_key}
    mon.sweep()  # the next sweep sees to the flags again
    flags = store.client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    assert (set("Ex") <= set(flags)) is enable, flags
    for m in mgrs:
        m.close()
    s.close()
    store.close()
    mon.events.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(5)) as resp:
        return str(resp.read().decode())


def test_monitor_subprocess_ledger_and_metrics(redis_url: str) -> None:
    """`kvstate monitor` as a real process: a 1 s room nobody clears lands in the ledger
    with its last status, and the metrics endpoint counts it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVSTATE_REDIS_URL"}
    proc = subprocess.Popen(
        [
            str(KVSTATE_BIN),
            "--url",
            redis_url,
            "monitor",
            "--metrics-port",
            str(port),
            "--metrics-addr",
            "127.0.0.1",
            "--interval",
            "200ms",
            "--audit-interval",
            "0",
            "--duration",
            "30s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert "metrics on" in first and "notifications on" in second, (first, second)
        s, mgrs = make_room(redis_url, 31)
        led = Ledger(s)
        assert wait_for(lambda: len(led.recent(10)) >= 2, 15.0), led.recent(10)
        got = sorted((e.room, e.side, e.status) for e in led.recent(10))
        assert got == [(31, "rx", "WaitingForInput"), (31, "tx", "WaitingForInput")]

        def counted() -> bool:  # one room, two participants
            text = scrape(port)
            m = re.search(r'kvstate_rooms_reaped_total\{status="WaitingForInput"\} (\S+)', text)
            n = re.findall(
                r'kvstate_participants_reaped_total\{side="[tr]x",'
                r'status="WaitingForInput"\} 1\.0',
                text,
            )
            return m is not None and float(m[1]) == 1.0 and len(n) == 2

        assert wait_for(counted, 5.0), scrape(port)
        text = scrape(port)
        assert 'kvstate_engines_alive{role="prefill"} 1.0' in text
        assert "kvstate_audit_findings" in text
        for m in mgrs:
            m.close()
        s.close()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=scaled(10))
    assert "reaped by TTL: room 31" in out, (out, err)
    assert "Traceback" not in err, err
    # SIGTERM: the sweep finishes, then 128 + 15, as the demo and `top` exit
    assert proc.returncode == 143 and "monitor stopped" in err, (proc.returncode, err)


def test_monitor_thread_with_metrics(store: Store, state_url: str) -> None:
    """The same loop in a thread, on standalone and Cluster (node-local events)."""
    metrics = Metrics()
    mon = Monitor(store, interval=0.1, metrics=metrics)
    mon.start()
    stop = threading.Event()
    t = threading.Thread(target=mon.run, args=(stop,), daemon=True)
    t.start()
    try:
        s, mgrs = make_room(state_url, 41)
        led = Ledger(store)
        assert wait_for(lambda: len(led.recent(10)) >= 2, 10.0)
        assert {e.status for e in led.recent(10)} == {"WaitingForInput"}
        text = metrics.render()
        assert b'kvstate_rooms_reaped_total{status="WaitingForInput"} 1.0' in text  # 1 room
        reaped = re.findall(rb"kvstate_participants_reaped_total\{side=.*\} (\S+)", text)
        assert sorted(float(n) for n in reaped if float(n)) == [1.0, 1.0], text
        assert len(reaped) == 12  # every side and status, at 0 until counted (issue 31)
        for m in mgrs:
            m.close()
        s.close()
    finally:
        stop.set()
        t.join(scaled(5))
    assert not t.is_alive()
