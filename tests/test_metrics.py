"""Prometheus metrics: private registries, gauges from a monitor sweep, the transfer hook,
and the HTTP endpoint."""

from __future__ import annotations

import urllib.request

import numpy as np

import kvstate
from kvstate import metrics as metrics_mod
from kvstate.audit import Auditor
from kvstate.ledger import Monitor
from kvstate.metrics import Metrics
from kvstate.poll import KVPoll

ADDR = "10.0.0.1:8998"


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    value = m.registry.get_sample_value(name, labels or None)
    return None if value is None else float(value)


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.observe_transfer(4096, 0.002)
    assert sample(a, "kvstate_transfer_bytes_total") == 4096
    assert sample(b, "kvstate_transfer_bytes_total") == 0
    assert sample(a, "kvstate_transfer_seconds_count") == 1


def test_module_hook_feeds_the_default_metrics() -> None:
    before = sample(metrics_mod.DEFAULT, "kvstate_transfer_bytes_total") or 0.0
    metrics_mod.observe_transfer(1000, 0.01)
    assert sample(metrics_mod.DEFAULT, "kvstate_transfer_bytes_total") == before + 1000


def test_sweep_sets_gauges(state_url: str) -> None:
    store = kvstate.connect(state_url)
    m = Metrics()
    mon = Monitor(store, metrics=m, audit=lambda: Auditor(store).run().counts(),
                  audit_interval=0)
    with kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p, \
            kvstate.KVManager(store, "decode", "decode-b") as d:
        snd, rcv = p.sender(1), d.receiver(1, ADDR)
        rcv.init(np.arange(4))
        assert snd.poll() == KVPoll.WaitingForInput
        p.sender(2).poll()
        store.client.sadd(store.keys.acks(9, "x"), "y")  # a key without TTL
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
            f"http://127.0.0.1:{server.server_port}/metrics", timeout=5
        ) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert 'kvstate_rooms_reaped_total{status="Transferring"} 3.0' in text
    assert "python_gc" not in text  # not the global registry
