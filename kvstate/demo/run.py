"""One run of the demo, start to summary: the router's (Redis, discovery record,
workers, rooms under a progress bar, the checks after), or one worker's attached to a
router elsewhere (``--worker``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

import kvstate
from kvstate.demo.engines import WORKERS
from kvstate.demo.messages import DEMO_OPTIONS, WorkerConfig
from kvstate.demo.outcome import Track
from kvstate.demo.queues import attach
from kvstate.demo.router import Interrupted, Options, Router, Signals
from kvstate.demo.summary import (
    console,
    print_summary,
    run_audit,
    run_keys,
    summary,
    take_transfer_counters,
    traces_kept,
    wait_for_no_keys,
)
from kvstate.ops.durations import fmt_ms
from kvstate.store import EMBEDDED, ENV_URL, Store, embedded

__all__ = ["EXIT_CHECK_FAILED", "discovery_path", "run_router", "run_worker"]

EXIT_CHECK_FAILED = 1
log = logging.getLogger(__name__)


def discovery_path(pid: int | None = None) -> Path:
    """Where a running demo announces its embedded Redis: ``kvstate show`` / ``ls`` read
    ``${XDG_RUNTIME_DIR:-/tmp}/kvstate-demo-<pid>.json`` ({"url", "namespace", "pid"})."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"kvstate-demo-{os.getpid() if pid is None else pid}.json"


@contextlib.contextmanager
def _announced(url: str, namespace: str) -> Iterator[Path]:
    """Write the discovery record for the run's lifetime (mode 0600), remove it after.
    Only the embedded server is announced: its unix URL holds no secret."""
    path = discovery_path()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "namespace": namespace, "pid": os.getpid()}, f)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def run_worker(role: str, engine: str, router: str, url: str | None, namespace: str | None) -> int:
    """A worker in its own container: logs what it does (``docker compose logs``);
    returns the signal that stopped it, 0 if the router said stop."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("KVSTATE_LOG_LEVEL", "INFO").upper(),
            format="%(asctime)s %(levelname)s %(message)s",
        )
    log.info("%s: attaching to router %s", engine, router)
    inbox, outbox, cfg = attach(router, engine)
    over = {k: v for k, v in (("url", url), ("namespace", namespace)) if v}
    cfg = WorkerConfig(**{**asdict(cfg), **over, "parent_pid": 0})
    got = WORKERS[role](cfg, engine, inbox, outbox)
    log.info("%s: %s", engine, f"stopped by {signal.Signals(got).name}" if got else "done")
    return got


def _banner(
    store: Store, cfg: WorkerConfig, opts: Options, embedded: bool, record: Path | None
) -> None:
    """Where the run's state lives and how to look at it while it runs (plain lines on
    stderr, never wrapped, so the commands can be copied)."""

    def say(text: str) -> None:
        click.echo(text, err=True)

    where = "embedded, stops with the demo" if embedded else "given"
    say(
        f"kvstate demo: Redis {store.url} ({where}), namespace {store.namespace}; "
        f"{opts.prefill_workers} prefill + {opts.decode_workers} decode worker(s), "
        f"{opts.requests} requests"
    )
    ns = store.namespace
    if record is not None:
        say(
            f"  inspect while it runs: kvstate ls  /  kvstate show ROOM  (they find this run "
            f"through {record})"
        )
        say(f"  or name it: kvstate --url {store.url} --namespace {ns} ls")
    else:
        say(f"  inspect while it runs: kvstate --url URL --namespace {ns} ls  /  show ROOM")
        say(
            f"  (URL: {store.url}; with a password, export {ENV_URL} rather than pass --url, "
            "which `ps` shows)"
        )
    say(
        f"  every room is traced (trace_rate {store.options.trace_rate:g}): kvstate trace ROOM "
        f"shows where its time went, for {fmt_ms(int(store.options.trace_ttl * 1000))} "
        "after its clear"
    )
    waves = -(-opts.requests // opts.inflight)  # rooms go in waves of --inflight
    if cfg.hold:
        say(
            f"  each room waits {fmt_ms(int(cfg.hold * 1000))} in WaitingForInput before its "
            f"transfer (--hold): {opts.requests} rooms, {opts.inflight} at a time, take at "
            f"least {fmt_ms(int(waves * cfg.hold * 1000))}"
        )
    else:
        say(
            f"  rooms live ~50 ms: --hold 30s keeps each one visible for 30 s, and then "
            f"{opts.requests} rooms, {opts.inflight} at a time, take at least "
            f"{fmt_ms(waves * 30_000)} (--requests {opts.inflight} --hold 30s: 30s)"
        )


def run_router(
    opts: Options, url: str | None, namespace: str, base: WorkerConfig, as_json: bool
) -> int:
    """The whole run; returns the exit status (0 only if every check held). Without a
    URL (or with ``embedded``) the demo asks for its own private redis-server, and hands
    its URL to every worker it spawns."""
    real_url = url if url is not None and url != EMBEDDED else embedded.ensure_server()
    own = real_url != url
    store = kvstate.connect(real_url, namespace, base.room_ttl, options=DEMO_OPTIONS)
    cfg = WorkerConfig(**{**asdict(base), "url": real_url, "namespace": store.namespace})
    err = console(stderr=True)
    announce = _announced(real_url, store.namespace) if own else contextlib.nullcontext(None)
    with announce as record, Signals() as signals:
        _banner(store, cfg, opts, own, record)
        rtr = Router(opts, cfg, store, signals)
        counts: dict[str, int] = {}
        seconds = 0.0
        before: dict[str, int] = {}
        try:
            try:
                rtr.start()
                before = store.command_counts()
                seconds = _progress(rtr, err, counts, as_json)
            except Interrupted:
                pass
            signals.urgent = True  # from here on, a signal stops the waiting at once
            rtr.stop()
        except KeyboardInterrupt:  # a second signal: no more waiting for the workers
            rtr.interrupted = rtr.interrupted or signals.got
        except BaseException:
            rtr.terminate()
            raise
        finally:
            signals.urgent = True
        rtr.terminate()  # a worker that did not say goodbye in time
        doc = _checked(store, opts, cfg, rtr, seconds, before, signals)
    store.close()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        print_summary(doc)
    if signals.last:
        return 128 + signals.last
    return 0 if doc["ok"] else EXIT_CHECK_FAILED


def _checked(
    store: Store,
    opts: Options,
    cfg: WorkerConfig,
    rtr: Router,
    seconds: float,
    before: dict[str, int],
    signals: Signals,
) -> dict[str, Any]:
    """The checks after the run (keys gone, audit, counters) and the summary. A signal
    here stops the waiting: what was not checked yet says so, the summary still comes."""
    after: dict[str, int] = {}
    counters: dict[str, dict[str, Any]] = {}
    left: list[str] | None = None
    traces: int | None = None
    others = 0
    waited = 0.0
    audit: dict[str, Any] = {"result": "skipped (interrupted)"}
    try:
        after = store.command_counts() if before else {}
        counters = take_transfer_counters(store, rtr)
        wait = cfg.room_ttl + cfg.lease + 5 if rtr.killed else cfg.lease + 2
        mine = run_keys(store, rtr)  # a shared namespace holds others' keys too
        left, waited, others = wait_for_no_keys(store, wait, mine)
        traces = traces_kept(store, mine)
        if not rtr.interrupted:
            audit = run_audit(store, mine)
    except KeyboardInterrupt:
        audit = {"result": f"skipped ({signal.Signals(signals.last).name})"}
    cut = signal.Signals(signals.last).name if signals.last and not rtr.interrupted else None
    return summary(
        opts, cfg, rtr, seconds, before, after, left, waited, audit, counters, cut, traces, others
    )


def _progress(rtr: Router, err: Any, counts: dict[str, int], as_json: bool) -> float:
    """Run the rooms under a progress bar; returns the seconds they took."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("rooms"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=err,
        transient=as_json,
    ) as progress:
        task = progress.add_task("rooms", total=rtr.opts.requests, counts="")

        def tick(track: Track) -> None:
            kind = track.outcome(rtr.killed)
            counts[kind] = counts.get(kind, 0) + 1
            progress.update(
                task, advance=1, counts=" ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            )

        return rtr.run(tick)
