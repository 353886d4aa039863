"""``kvstate monitor``: keep the leak ledger and export Prometheus metrics."""

from __future__ import annotations

import json
import sys
import threading

import click

from kvstate.cli.app import DURATION, PERIOD, Ctx, Failure, Stopper, common, main, opened
from kvstate.ops.audit import DEFAULT_GRACE, Auditor
from kvstate.ops.durations import fmt_ms
from kvstate.ops.ledger import Entry, Monitor
from kvstate.ops.metrics import Metrics


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
        with Stopper() as stopper:
            gone = _watch_gone(obj, stopper.event, interval)
            try:
                mon.run(stopper.event, duration)
            finally:
                stopper.event.set()  # ends the watch
                if server is not None and hasattr(server, "shutdown"):
                    server.shutdown()
        click.echo(f"monitor stopped after {mon.sweeps} sweep(s)", err=True)
    if gone:
        raise Failure(gone[0])
    sys.exit(stopper.exit_code)


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
