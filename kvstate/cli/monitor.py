"""``kvstate monitor``: keep the leak ledger and export Prometheus metrics."""

from __future__ import annotations

import json
import signal
import threading

import click

from kvstate.cli.app import DURATION, PERIOD, Ctx, common, main, opened
from kvstate.ops.audit import DEFAULT_GRACE, Auditor
from kvstate.ops.ledger import Entry, Monitor
from kvstate.ops.metrics import Metrics
from kvstate.ops.views import fmt_ms


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
    export Prometheus metrics."""
    with opened(obj, patient=True) as store:
        metrics = Metrics()
        auditor = Auditor(store, grace)

        def show_entry(e: Entry) -> None:
            if as_json:
                click.echo(json.dumps(e.to_json()))
            else:
                click.echo(
                    f"reaped by TTL: room {e.room} {e.side}:{e.engine}, last status "
                    f"{e.status}, age {fmt_ms(e.age_ms)} ({e.detail})"
                )

        mon = Monitor(
            store,
            interval,
            metrics=metrics,
            notifications=not no_notify,
            audit=lambda: auditor.run().counts(),
            audit_interval=audit_interval,
            on_entry=show_entry,
        )
        note = mon.start()
        server = None
        if metrics_port is not None:
            server = metrics.serve(metrics_port, metrics_addr)
            port = server.server_port if hasattr(server, "server_port") else metrics_port
            note += f"; metrics on http://{metrics_addr}:{port}/metrics"
        click.echo(
            f"monitoring namespace {store.namespace} at {store.url} every {interval:g}s: {note}",
            err=as_json,
        )
        stop = threading.Event()
        previous = None
        if threading.current_thread() is threading.main_thread():  # SIGTERM: finish the sweep
            previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            mon.run(stop, duration)
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if server is not None and hasattr(server, "shutdown"):
                server.shutdown()
        click.echo(f"monitor stopped after {mon.sweeps} sweep(s)", err=True)
