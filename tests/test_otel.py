"""Room traces in OpenTelemetry (issue 31): `kvstate monitor`, given an OTLP endpoint the
standard way ($OTEL_EXPORTER_OTLP_ENDPOINT), exports each traced room that ended as one
trace (a root span, a span per phase, aborts and failures as span events, a link to the
serving request's trace), to a real OTLP/HTTP receiver in a process of its own
(`python -m kvstate.testing.otlp`, which decodes what it is sent with
opentelemetry-proto). The monitor also serves the phases as a histogram and
`kvstate_build_info`. The engines add no round trip for any of it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import kvstate
from kvstate.cli import main
from kvstate.errors import InvalidArgumentError
from kvstate.poll import KVPoll
from kvstate.store import Store
from kvstate.testing import RoundTrips
from kvstate.trace import traceparent
from tests.helpers import demo_env, scaled, wait_for

pytest.importorskip("opentelemetry.sdk.trace", reason="the [otel] extra (kvstate[test] has it)")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

KVSTATE_BIN = Path(sys.executable).with_name("kvstate")
ADDR = "10.0.0.1:8998"
ALL = kvstate.Options(trace_rate=1.0)
REQUEST_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
REQUEST_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{REQUEST_TRACE}-{REQUEST_SPAN}-01"


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The OTLP/HTTP receiver process: (its endpoint, the file it writes spans to)."""
    out = tmp_path / "spans.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstate.testing.otlp", "--out", str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=demo_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.split()[-1], out
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))


def _spans(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int, **kw: Any) -> None:
    snd = p.sender(room, trace_context=kw.get("tx"))
    rcv = d.receiver(room, ADDR, trace_context=kw.get("rx"))
    rcv.init(np.arange(4))
    assert snd.poll() == KVPoll.WaitingForInput
    assert snd.begin_transfer() == KVPoll.Transferring
    if kw.get("abort"):
        rcv.abort(kw["abort"])
        assert snd.poll() == KVPoll.Failed
    else:
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success
    snd.clear()
    rcv.clear()


def test_monitor_exports_each_ended_room_as_one_trace(
    redis_url: str, receiver: tuple[str, Path], tmp_path: Path
) -> None:
    endpoint, out = receiver
    env = demo_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: the SDK's batch goes out soon
        OTEL_SERVICE_NAME="kvstate-monitor-test",
    )
    err_path = tmp_path / "err"
    with err_path.open("w") as err:
        mon = subprocess.Popen(
            [str(KVSTATE_BIN), "--url", redis_url, "monitor", "--interval", "200ms"]
            + ["--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--json"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            env=env,
        )
    store = kvstate.connect(redis_url, options=ALL)
    try:
        assert wait_for(lambda: "monitoring namespace" in err_path.read_text(), scaled(30))
        text = err_path.read_text()
        assert f"room traces to OTLP at {endpoint}" in text, text
        port = int(re.findall(r"127\.0\.0\.1:(\d+)/metrics", text)[0])
        with (
            kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
            kvstate.KVManager(store, "decode", "decode-b") as d,
        ):
            _lifecycle(p, d, 101, tx=TRACEPARENT)
            _lifecycle(p, d, 102, abort="decode preempted")
            live = p.sender(103)  # still live: not exported
            assert live.poll() == KVPoll.Bootstrapping

            def rooms() -> set[str]:
                return {
                    s["attributes"]["kvstate.room"]
                    for s in _spans(out)
                    if s["name"] == "kvstate room"
                }

            assert wait_for(lambda: rooms() == {"101", "102"}, scaled(30)), _spans(out)
            live.abort("test over")
            live.clear()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        mon.send_signal(signal.SIGINT)
        mon.wait(timeout=scaled(30))
        store.close()
    assert mon.returncode == 130, err_path.read_text()

    spans = _spans(out)
    by_room: dict[str, list[dict[str, Any]]] = {}
    roots = {s["attributes"]["kvstate.room"]: s for s in spans if s["name"] == "kvstate room"}
    for s in spans:
        for room, root in roots.items():
            if s["trace_id"] == root["trace_id"]:
                by_room.setdefault(room, []).append(s)
    ok, failed = roots["101"], roots["102"]
    assert ok["trace_id"] != failed["trace_id"]  # one trace per room
    assert ok["resource"]["service.name"] == "kvstate-monitor-test"
    assert ok["attributes"]["kvstate.outcome"] == "Success"
    assert ok["attributes"]["kvstate.namespace"] == "default"
    assert ok["parent_span_id"] == "" and ok["status"]["code"] != 2
    # the phases: children of the root, inside it, in order
    children = sorted(
        (s for s in by_room["101"] if s["parent_span_id"] == ok["span_id"]),
        key=lambda s: s["start_ns"],
    )
    assert [c["name"] for c in children] == [
        "bootstrap",
        "waiting for input",
        "transfer",
        "until clear",
    ]
    assert [c["attributes"]["kvstate.phase"] for c in children][-1] == "until_clear"
    assert children[0]["start_ns"] == ok["start_ns"] and children[-1]["end_ns"] == ok["end_ns"]
    for a, b in zip(children, children[1:], strict=False):
        assert a["end_ns"] == b["start_ns"]
    # linked to the serving request's trace
    assert [(x["trace_id"], x["span_id"]) for x in ok["links"]] == [(REQUEST_TRACE, REQUEST_SPAN)]
    assert ok["links"][0]["attributes"] == {"kvstate.side": "tx", "kvstate.engine": "prefill-a"}
    # the aborted room: its reason as span events, the span in error
    assert failed["status"]["code"] == 2 and "decode preempted" in failed["status"]["message"]
    events = [e for e in failed["events"] if e["name"] == "kvstate.abort"]
    assert events and all("decode preempted" in e["attributes"]["kvstate.reason"] for e in events)
    assert {e["attributes"]["kvstate.side"] for e in events} == {"tx", "rx"}
    assert failed["links"] == []
    assert [c["name"] for c in by_room["102"] if c["parent_span_id"]][-2:] == [
        "transfer until failure",
        "until clear",
    ]
    # and the monitor's own metrics: the phases as a histogram, its build
    text = metrics.decode()
    count = r'kvstate_room_phase_seconds_count\{outcome="(\w+)",phase="transfer"\} (\S+)'
    assert {o: float(n) for o, n in re.findall(count, text)} == {"success": 1.0, "failed": 1.0}
    assert re.search(r'^kvstate_build_info\{.*version="[^"]+".*\} 1\.0$', text, re.M), text


def _lifecycle_trips(store: Store, room: int, context: str | None) -> int:
    with (
        kvstate.KVManager(store, "prefill", f"p{room}", ADDR) as p,
        kvstate.KVManager(store, "decode", f"d{room}") as d,
        RoundTrips.installed() as trips,
    ):
        before = trips.by_thread["MainThread"]
        snd = p.sender(room, trace_context=context)
        rcv = d.receiver(room, ADDR, trace_context=context)
        rcv.init(np.arange(4))
        assert snd.poll() == KVPoll.WaitingForInput
        snd.begin_transfer()
        snd.finish_transfer()
        rcv.poll()
        snd.clear()
        rcv.clear()
        return trips.by_thread["MainThread"] - before


def test_request_context_is_kept_without_a_round_trip(redis_url: str) -> None:
    """The trace context rides in the create's batch (design.md, The room trace: no
    round trip added), lands in a traced room's trace only, and is checked."""
    with kvstate.connect(redis_url, options=ALL) as store:
        assert _lifecycle_trips(store, 201, TRACEPARENT) == _lifecycle_trips(store, 202, None)
        doc = json.loads(
            CliRunner().invoke(main, ["--url", redis_url, "trace", "201", "--json"]).stdout
        )
        assert sorted(doc["request_traces"], key=lambda c: c["side"]) == [
            {"side": "rx", "engine": "d201", "traceparent": TRACEPARENT},
            {"side": "tx", "engine": "p201", "traceparent": TRACEPARENT},
        ]
        assert all(s["event"] != "context" for s in doc["steps"])  # no step of the room
        with (
            kvstate.KVManager(store, "prefill", "p9", ADDR) as p,
            pytest.raises(InvalidArgumentError, match="traceparent"),
        ):
            p.sender(9, trace_context="not-a-context")
    with kvstate.connect(redis_url, options=kvstate.Options(trace_rate=0.0)) as untraced:
        _lifecycle_trips(untraced, 203, TRACEPARENT)
        assert untraced.client.exists(untraced.keys.trace(203)) == 0  # nothing written
    assert traceparent(TRACEPARENT.upper()) == TRACEPARENT
    for bad in (None, "", "00-" + "0" * 32 + "-" + REQUEST_SPAN + "-01", "01-x-y-z"):
        assert traceparent(bad) is None


def test_monitor_without_the_extra_says_what_to_install(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint set where the SDK is missing: one line naming the extra, exit 2."""
    shadow = tmp_path / "shadow" / "opentelemetry"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    env = demo_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1")
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [str(KVSTATE_BIN), "--url", redis_url, "monitor", "--duration", "1s"],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(60),
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'kvstate[otel]'" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
