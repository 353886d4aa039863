"""``kvstate monitor``: keep the leak ledger and export Prometheus metrics."""

from __future__ import annotations

import json
import sys
import threading
import time

import click

from kvstate.cli.app import (
    DURATION,
    PERIOD,
    Ctx,
    common,
    describe,
    main,
)
from kvstate.cli.process import Stopper, now_stamp, stamp_log_lines
from kvstate.errors import AuthenticationFailedError, KVStateError, StateConnectionError
from kvstate.ops import otel
from kvstate.ops.audit import DEFAULT_GRACE, Auditor
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import CommandError
from kvstate.ops.ledger import Entry
from kvstate.ops.metrics import Metrics
from kvstate.ops.monitor import Monitor
from kvstate.store import Store


@main.command()
@common
@click.option(
    "--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus metrics on this port."
)
@click.option(
    "--metrics-addr", default="0.0.0.0", show_default=True, help="Address the metrics server binds."
)
@click.option(
    "--interval",
    type=PERIOD,
    default=5.0,
    show_default=True,
    help="Sweep period (at least 100ms); keep it well below the room TTL.",
)
@click.option(
    "--audit-interval",
    type=DURATION,
    default=60.0,
    show_default=True,
    help="How often the audit gauges are refreshed (0: every sweep).",
)
@click.option(
    "--grace",
    type=DURATION,
    default=DEFAULT_GRACE,
    show_default=True,
    help="Grace period for the audit gauges.",
)
@click.option(
    "--no-notify",
    is_flag=True,
    help="Never CONFIG SET notify-keyspace-events (use it only if already on).",
)
@click.option(
    "--duration", type=DURATION, help="Stop after this long (default: run until interrupted)."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per ledger entry.")
@click.pass_obj
def monitor(
    obj: Ctx,
    metrics_port: int | None,
    metrics_addr: str,
    interval: float,
    audit_interval: float,
    grace: float,
    no_notify: bool,
    duration: float | None,
    as_json: bool,
) -> None:
    """Keep the leak ledger (participants reaped by TTL, with their last status) and
    export Prometheus metrics. A Redis that is down, at start or later, is waited for
    (kvstate_up 0 meanwhile); every line it prints starts with the time (UTC)."""
    stamp_log_lines()
    metrics = Metrics()
    exporter = None
    if (otlp := otel.endpoint()) is not None:  # before Redis: a missing extra is exit 2
        exporter = otel.RoomExporter()
        say(f"room traces to OTLP at {otlp} (each traced room once it ended)", err=as_json)
    server = None
    if metrics_port is not None:
        server = metrics.serve(metrics_port, metrics_addr)
        port = server.server_port if hasattr(server, "server_port") else metrics_port
        say(f"metrics on http://{metrics_addr}:{port}/metrics", err=as_json)
    try:
        with Stopper() as stopper:
            store = _connect(obj, metrics, interval, stopper, duration)
            if store is None:  # stopped while Redis was down
                say("monitor stopped before Redis answered", err=True)
                sys.exit(stopper.exit_code)
            try:
                gone = _run(
                    obj,
                    store,
                    metrics,
                    stopper,
                    as_json,
                    interval,
                    duration,
                    audit_interval=audit_interval,
                    grace=grace,
                    no_notify=no_notify,
                    exporter=exporter,
                )
            finally:
                store.close()
    finally:
        if server is not None and hasattr(server, "shutdown"):
            server.shutdown()
        if exporter is not None:
            exporter.close()  # what is queued goes out
    if gone:
        raise CommandError(gone[0])
    sys.exit(stopper.exit_code)


def say(text: str, err: bool = True) -> None:
    """One line of the monitor's, after the time (UTC, to the second)."""
    click.echo(f"{now_stamp()} {text}", err=err)


def _connect(
    obj: Ctx, metrics: Metrics, interval: float, stopper: Stopper, duration: float | None
) -> Store | None:
    """Connect, waiting for a Redis that is down (its scrape says kvstate_up 0 meanwhile,
    as redis_exporter's says redis_up 0); None when stopped (or ``duration`` ran out)
    first. A Redis gone for good (a demo's, exited) and errors no retry mends (a bad
    URL, a refused password) end the monitor."""
    down_since = None
    end = None if duration is None else time.monotonic() + duration
    while True:
        try:
            store = obj.store(patient=True)
        except AuthenticationFailedError:
            raise
        except StateConnectionError as exc:
            why = obj.gone()
            if why is not None:
                raise CommandError(why) from None
            metrics.sweep_failed()
            if down_since is None:
                down_since = time.monotonic()
                say(
                    f"kvstate monitor: Redis unreachable at start: {describe(exc)}; serving "
                    f"kvstate_up 0 and retrying every {fmt_ms(int(interval * 1000))}"
                )
            wait = interval if end is None else min(interval, end - time.monotonic())
            if stopper.wait(max(0.0, wait)) or (end is not None and time.monotonic() >= end):
                return None
            continue
        if down_since is not None:
            say(
                f"kvstate monitor: Redis at {store.url} is back after "
                f"{fmt_ms(int((time.monotonic() - down_since) * 1000))}"
            )
        return store


def _run(
    obj: Ctx,
    store: Store,
    metrics: Metrics,
    stopper: Stopper,
    as_json: bool,
    interval: float,
    duration: float | None,
    *,
    audit_interval: float,
    grace: float,
    no_notify: bool,
    exporter: otel.RoomExporter | None,
) -> list[str]:
    """Sweep until stopped; answers why Redis is gone for good, if it is."""
    auditor = Auditor(store, grace)
    ended = otel.EndedRooms(store, store.server_time_ms())

    def rooms_ended() -> None:
        """Traced rooms that ended since the last sweep: their phases into the
        histogram, and their spans to OTLP when configured."""
        for t in ended.poll():
            phases = [(otel.phase_label(p.name), p.ms / 1000) for p in t.phases()]
            metrics.observe_room(phases, t.failure is not None)
            if exporter is not None:
                exporter.export(t, store.namespace)

    def show_entry(e: Entry) -> None:
        if as_json:
            click.echo(json.dumps(e.to_json()))
        else:
            say(
                f"reaped by TTL: room {e.room} {e.side}:{e.engine}, last status "
                f"{e.status}, age {fmt_ms(e.age_ms)} ({e.detail})",
                err=False,
            )

    def down(exc: KVStateError) -> None:
        say(
            f"kvstate monitor: Redis unreachable: {describe(exc)}; serving kvstate_up 0 "
            f"and retrying every {fmt_ms(int(interval * 1000))}"
        )

    def back(seconds: float, failed: int) -> None:
        say(
            f"kvstate monitor: Redis at {store.url} is back after "
            f"{fmt_ms(int(seconds * 1000))} ({failed} failed sweep(s))"
        )

    mon = Monitor(
        store,
        interval,
        metrics=metrics,
        notifications=not no_notify,
        audit=lambda: auditor.run().counts(),
        audit_interval=audit_interval,
        on_entry=show_entry,
        after_sweep=rooms_ended,
    )
    note = mon.start()
    say(
        f"monitoring namespace {store.namespace} at {store.url} every "
        f"{fmt_ms(int(interval * 1000))}: {note}",
        err=as_json,
    )
    gone = _watch_gone(obj, stopper.event, interval)
    try:
        mon.run(stopper.event, duration, on_down=down, on_back=back)
    finally:
        stopper.event.set()  # ends the watch
    say(f"monitor stopped after {mon.sweeps} sweep(s)")
    return gone


def _watch_gone(obj: Ctx, stop: threading.Event, interval: float) -> list[str]:
    """Stop the monitor once its Redis is gone for good (a demo's embedded server after
    the demo exited): a restart is waited for, that never comes back. Returns the
    list the reason lands in."""
    found: list[str] = []

    def watch() -> None:
        while not stop.wait(interval):
            why = obj.gone()
            if why is not None:
                found.append(why)
                stop.set()

    threading.Thread(target=watch, name="kvstate-monitor-gone", daemon=True).start()
    return found
