"""Prometheus metrics: private registries, gauges from a monitor sweep, the transfer hook,
and the HTTP endpoint."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import kvstate
from kvstate.errors import MetricsPortError
from kvstate.ops import metrics as metrics_mod
from kvstate.ops.audit import Auditor
from kvstate.ops.metrics import Metrics, read_transfer_totals
from kvstate.ops.monitor import Monitor
from kvstate.poll import KVPoll
from kvstate.stats import STATS_TTL_S
from tests.helpers import keys_of, scaled, wait_for

ADDR = "10.0.0.1:8998"


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    value = m.registry.get_sample_value(name, labels or None)
    return None if value is None else float(value)


LOCAL = {"engine": metrics_mod.LOCAL_ENGINE}


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.observe_transfer(4096, 0.002)
    assert sample(a, "kvstate_transfer_bytes_total", **LOCAL) == 4096
    assert sample(b, "kvstate_transfer_bytes_total", **LOCAL) is None
    assert sample(a, "kvstate_transfer_seconds_count", **LOCAL) == 1
    assert sample(a, "kvstate_transfer_seconds_bucket", le="0.0025", **LOCAL) == 1
    assert sample(a, "kvstate_transfer_seconds_bucket", le="0.001", **LOCAL) == 0


def test_module_hook_feeds_the_default_metrics() -> None:
    before = sample(metrics_mod.DEFAULT, "kvstate_transfer_bytes_total", **LOCAL) or 0.0
    metrics_mod.observe_transfer(1000, 0.01)
    assert sample(metrics_mod.DEFAULT, "kvstate_transfer_bytes_total", **LOCAL) == before + 1000


def test_recorder_publishes_totals_another_process_reads(redis_url: str) -> None:
    """What an engine records reaches a monitor in another process through Redis: the
    figures are absolute (a retried write cannot double count), keyed per engine, with
    a TTL, and throttled (observe() alone writes at most once per flush interval)."""
    script = (
        "import sys, kvstate\n"
        "from kvstate.stats import TransferRecorder\n"
        "store = kvstate.connect(sys.argv[1], 'm')\n"
        "rec = TransferRecorder(store, 'prefill-x', flush_interval=3600)\n"
        "for i in range(5): rec.observe(1 << 20, 0.004)\n"
        "rec.close()\n"
    )
    subprocess.run([sys.executable, "-c", script, redis_url], check=True, timeout=scaled(60))
    store = kvstate.connect(redis_url, "m")
    totals = read_transfer_totals(store)
    assert set(totals) == {"prefill-x"}
    assert (totals["prefill-x"].bytes, totals["prefill-x"].count) == (5 << 20, 5)
    key = store.keys.transfer_stats("prefill-x")
    assert 0 < store.client.pttl(key) <= STATS_TTL_S * 1000
    assert store.client.hget(key, "le:0.005") == b"5"  # readable with redis-cli
    m = Metrics()
    m.load_transfers(store)
    assert sample(m, "kvstate_transfer_bytes_total", engine="prefill-x") == 5 << 20
    assert sample(m, "kvstate_transfer_seconds_count", engine="prefill-x") == 5
    assert sample(m, "kvstate_transfer_seconds_sum", engine="prefill-x") == pytest.approx(0.02)
    text = m.render().decode()
    assert 'kvstate_transfer_bytes_total{engine="prefill-x"} 5.24288e+06' in text
    store.close()


def test_monitor_exports_the_demo_workers_transfers(redis_url: str) -> None:
    """Real transfers in other processes (a demo run against this Redis) show up in the
    monitor's export while they happen; the demo's summary reads the same counters."""
    ns = "mdemo"
    cmd = [
        sys.executable,
        "-m",
        "kvstate.demo",
        "--url",
        redis_url,
        "--namespace",
        ns,
        "--requests",
        "40",
        "--hold",
        "0.3",
        "--page-bytes",
        "4k",
        "--pool-pages",
        "256",
        "--pages-per-request",
        "8-8",
        "--seed",
        "1",
        "--json",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = kvstate.connect(redis_url, ns)
    m = Metrics()
    mon = Monitor(store, metrics=m, notifications=False)
    seen = 0.0
    try:
        while proc.poll() is None:
            mon.sweep()
            seen = max(seen, sample(m, "kvstate_transfer_bytes_total", engine="prefill-0") or 0)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert seen > 0, "the monitor never saw the workers' transfer bytes"
    assert seen <= doc["bytes_verified"]
    assert doc["transfer_counters"]["prefill-0"]["bytes"] == doc["bytes_verified"]
    assert doc["transfer_counters"]["prefill-0"]["transfers"] == 40
    assert doc["keys_left"] == 0 and keys_of(store) == []  # room traces (with TTLs) aside
    assert doc["traces_kept"] == 40
    store.close()


def test_rooms_reaped_counts_rooms_not_participants(redis_url: str) -> None:
    """Both participants of a room expire (in one sweep or two): one room reaped."""
    store = kvstate.connect(redis_url, room_ttl=1.0)
    m = Metrics()
    mon = Monitor(store, interval=0.2, metrics=m, notifications=True)
    mon.start()
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        snd, rcv = p.sender(7), d.receiver(7, ADDR)
        rcv.init(np.arange(4))
        assert snd.poll() == KVPoll.WaitingForInput
        mon.sweep()
        deadline = time.monotonic() + scaled(15)
        while time.monotonic() < deadline and any(
            (
                sample(m, "kvstate_participants_reaped_total", side=side, status="WaitingForInput")
                or 0
            )
            < 1
            for side in ("tx", "rx")
        ):
            time.sleep(0.2)
            mon.sweep()
    mon.events.close()
    assert sample(m, "kvstate_participants_reaped_total", side="tx", status="WaitingForInput") == 1
    assert sample(m, "kvstate_participants_reaped_total", side="rx", status="WaitingForInput") == 1
    assert sample(m, "kvstate_rooms_reaped_total", status="WaitingForInput") == 1
    store.close()


def test_busy_metrics_port_is_a_clear_error(redis_url: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MetricsPortError, match="already in use.*--metrics-port"):
            Metrics().serve(port, "127.0.0.1")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstate.cli",
                "--url",
                redis_url,
                "monitor",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                "127.0.0.1",
                "--duration",
                "1s",
            ],
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
    assert result.returncode == 2, result.stderr
    assert f"metrics port 127.0.0.1:{port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr and "OSError" not in result.stderr


def test_sweep_sets_gauges(state_url: str) -> None:
    store = kvstate.connect(state_url)
    m = Metrics()
    mon = Monitor(store, metrics=m, audit=lambda: Auditor(store).run().counts(), audit_interval=0)
    with (
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
        kvstate.KVManager(store, "decode", "decode-b") as d,
    ):
        snd, rcv = p.sender(1), d.receiver(1, ADDR)
        rcv.init(np.arange(4))
        assert snd.poll() == KVPoll.WaitingForInput
        p.sender(2).poll()
        store.client.hset(store.keys.room_hash(9), "ack:x", "y")  # a key without TTL
        mon.sweep()
        mon._maybe_audit()
    assert sample(m, "kvstate_participants", side="tx", status="WaitingForInput") == 1
    assert sample(m, "kvstate_participants", side="tx", status="Bootstrapping") == 1
    assert sample(m, "kvstate_participants", side="rx", status="WaitingForInput") == 1
    assert sample(m, "kvstate_participants", side="rx", status="Failed") == 0
    assert sample(m, "kvstate_inflight_participants", age="<10s") == 3
    assert sample(m, "kvstate_engines_alive", role="prefill") == 1
    assert sample(m, "kvstate_engines_alive", role="decode") == 1
    assert sample(m, "kvstate_audit_findings", kind="no_ttl") == 1
    assert sample(m, "kvstate_audit_findings", kind="stuck") == 0
    store.close()


def test_http_endpoint_serves_the_registry() -> None:
    m = Metrics()
    m.reaped.labels("Transferring").inc(3)
    server = m.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{server.server_port}/metrics", timeout=scaled(5)
        ) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert 'kvstate_rooms_reaped_total{status="Transferring"} 3.0' in text
    assert "process_cpu_seconds_total" in text  # the standard collectors
    assert text.count("# TYPE kvstate_rooms_reaped_total counter") == 1


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=scaled(5)) as resp:
        return str(resp.read().decode())


def _value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_failed_sweep_reads_as_down_not_as_the_last_counts(
    redis_server_factory: Any, tmp_path: Any
) -> None:
    """With Redis stopped under `kvstate monitor --metrics-port`, the endpoint kept
    answering the last gauges (`kvstate_participants{...} 1.0`) and nothing said the
    sweep failed. Now `kvstate_up` is 0, the gauges read from Redis are gone, the time of
    the last good sweep stays, and the process_* metrics are there; all back once Redis
    is."""
    server = redis_server_factory(port="auto")
    store = kvstate.connect(server.tcp_url)
    p = kvstate.KVManager(store, "prefill", "prefill-a", ADDR)
    p.sender(3).poll()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstate.cli", "--url", server.tcp_url, "monitor"]
        + ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--interval", "200ms"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "err").open("w"),
        stdin=subprocess.DEVNULL,
    )
    texts: list[str] = []

    def scraped(pred: Any) -> bool:
        try:
            texts.append(_scrape(port))
        except OSError:
            return False
        return bool(pred(texts[-1]))

    try:
        assert wait_for(lambda: scraped(lambda t: _value(t, "kvstate_up") == 1), 60)
        up = texts[-1]
        assert 'kvstate_participants{side="tx",status="Bootstrapping"} 1.0' in up
        assert _value(up, "process_cpu_seconds_total") is not None
        assert _value(up, "process_resident_memory_bytes") is not None
        good = _value(up, "kvstate_last_good_sweep_timestamp_seconds")
        assert good is not None and abs(good - time.time()) < scaled(30)
        server.kill()
        assert wait_for(lambda: scraped(lambda t: _value(t, "kvstate_up") == 0), 60)
        down = texts[-1]
        assert "kvstate_participants{" not in down and "kvstate_engines_alive{" not in down
        assert "kvstate_inflight_participants{" not in down
        assert (_value(down, "kvstate_monitor_sweep_failures_total") or 0) >= 1
        stale = _value(down, "kvstate_last_good_sweep_timestamp_seconds")
        assert stale is not None and good <= stale < time.time()
        server.restart()
        assert wait_for(lambda: scraped(lambda t: _value(t, "kvstate_up") == 1), 60)
        assert 'kvstate_participants{side="tx",status="Bootstrapping"} 0.0' in texts[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=scaled(30))
        p.close()
        store.close()
    assert proc.returncode == 128 + signal.SIGTERM
