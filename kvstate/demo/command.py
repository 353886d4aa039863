"""``kvstate demo``: the click command, its options and how its errors are shown.

See the package docstring for what a run does; ``run`` holds the run itself."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
from collections.abc import Iterator

import click

from kvstate.defaults import LEASE
from kvstate.demo.messages import DEMO_ROOM_TTL, WorkerConfig
from kvstate.demo.pattern import cuda_backend
from kvstate.demo.queues import ENV_AUTHKEY, authkey
from kvstate.demo.router import Options
from kvstate.demo.run import run_router, run_worker
from kvstate.errors import KVStateError
from kvstate.ops.durations import Duration, fmt_ms
from kvstate.ops.exits import EXIT_ERROR, CommandError
from kvstate.store import ENV_NAMESPACE, ENV_URL, URL_SOURCE, redact

__all__ = ["EXIT_ERROR", "demo"]

KILL_LEASE = 2.0  # s: with --kill-prefill-after, so the killed worker's rooms fail soon
KILL_ROOM_TTL = 8.0  # s: and their keys expire within the run
NO_UCX = (
    "the demo's workers move KV pages with UCX and ucxx is not installed here: "
    "pip install 'kvstate[ucx]'"
)


_PAGES = "--pages-per-request"


def _pages_range(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise click.BadParameter(
            f"expected MIN-MAX page counts, got {value!r}", param_hint=_PAGES
        ) from None
    if a < 1 or b < a:
        raise click.BadParameter(f"need 1 <= MIN <= MAX, got {value!r}", param_hint=_PAGES)
    return a, b


def _size(value: str) -> int:
    units = {"k": 1024, "kib": 1024, "m": 1 << 20, "mib": 1 << 20, "": 1, "b": 1}
    text = value.strip().lower()
    num = text.rstrip("kmib")
    try:
        n = int(num) * units[text[len(num) :]]
    except (ValueError, KeyError):
        raise click.BadParameter(
            f"expected a size like 16384, 16k or 1m, got {value!r}", param_hint="--page-bytes"
        ) from None
    if n < 64 or n % 64:
        raise click.BadParameter(
            f"page size must be a positive multiple of 64 bytes, got {n}",
            param_hint="--page-bytes",
        )
    return n


@contextlib.contextmanager
def _errors(url: str | None) -> Iterator[None]:
    try:
        yield
    except (KVStateError, OSError) as exc:
        text = str(exc).replace(URL_SOURCE, f"--url or ${ENV_URL}")
        if url:
            text = text.replace(url, redact(url))
        raise CommandError(text, prog="kvstate demo") from None


def _require_ucx() -> None:
    """UCX is an extra (``kvstate[ucx]``): say how to get it before any worker starts,
    rather than let each one fail with a traceback."""
    if importlib.util.find_spec("ucxx") is None:
        raise CommandError(NO_UCX, prog="kvstate demo")


@click.command()
@click.option(
    "--url",
    metavar="URL",
    help=f"Redis URL (else ${ENV_URL}, else an embedded "
    f"redis-server started for this run). A password here shows in `ps`: prefer "
    f"${ENV_URL}.",
)
@click.option(
    "--namespace",
    metavar="NS",
    help=f"kvstate namespace (else ${ENV_NAMESPACE}, "
    "else demo-<random>, so a shared Redis keeps runs apart).",
)
@click.option(
    "--requests",
    "n_requests",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Rooms to push through.",
)
@click.option("--prefill-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--decode-workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--pages-per-request",
    default="4-64",
    show_default=True,
    metavar="MIN-MAX",
    help="Random request length in pages.",
)
@click.option(
    "--page-bytes",
    default="16k",
    show_default=True,
    help="Bytes per page per layer (16k, 4096, 1m).",
)
@click.option(
    "--pool-pages",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Pages in each worker's KV pool.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="KV buffers per worker (one registered array each).",
)
@click.option(
    "--inflight",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Rooms the router keeps in flight.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the KV pools live.",
)
@click.option(
    "--abort-rate",
    type=click.FloatRange(0.0, 1.0),
    default=0.0,
    show_default=True,
    help="Fraction of rooms aborted mid-way by the prefill side, the decode side "
    "or out of band (Store.abort).",
)
@click.option(
    "--kill-prefill-after",
    type=click.IntRange(min=0),
    metavar="N",
    help="SIGKILL one prefill worker after N rooms completed.",
)
@click.option(
    "--lease",
    type=Duration(minimum=0.1),
    help=f"Engine lease (2s, or 2 for seconds) [default: {fmt_ms(int(KILL_LEASE * 1000))} "
    f"with --kill-prefill-after, else {fmt_ms(int(LEASE * 1000))}].",
)
@click.option(
    "--room-ttl",
    type=Duration(minimum=1.0),
    help="Room key TTL "
    f"[default: {fmt_ms(int(KILL_ROOM_TTL * 1000))} with --kill-prefill-after, else "
    f"{fmt_ms(int(DEMO_ROOM_TTL * 1000))}; at least --hold + 1m].",
)
@click.option(
    "--timeout",
    type=Duration(minimum=1.0),
    default="30s",
    show_default=True,
    help="Bootstrap, waiting and transfer timeouts of the workers' rooms "
    "(raised to --hold + 30s when that is longer).",
)
@click.option(
    "--hold",
    type=Duration(),
    default=0.0,
    metavar="DURATION",
    help="Keep each room in WaitingForInput this long (30s, or 30 for seconds) before "
    "its transfer, so `kvstate ls` / `show` can catch it (rooms otherwise live ~50 ms). "
    "The run then takes about --requests / --inflight x --hold.",
)
@click.option("--seed", type=int, help="Seed for rooms, lengths, workers and faults.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--listen",
    metavar="HOST:PORT",
    help="Serve the queues over TCP and wait for "
    "workers prefill-0.. and decode-0.. started with --worker/--router "
    f"(docker-compose) instead of spawning them. Needs ${ENV_AUTHKEY}.",
)
@click.option(
    "--worker",
    type=click.Choice(["prefill", "decode"]),
    help="Run one worker attached to a router started with --listen.",
)
@click.option("--engine", help="Engine id of this worker (with --worker), e.g. prefill-0.")
@click.option(
    "--router",
    metavar="HOST:PORT",
    help=f"The router to attach to (with --worker; needs ${ENV_AUTHKEY}, the router's secret).",
)
@click.pass_context
def demo(
    ctx: click.Context,
    url: str | None,
    namespace: str | None,
    n_requests: int,
    prefill_workers: int,
    decode_workers: int,
    pages_per_request: str,
    page_bytes: str,
    pool_pages: int,
    layers: int,
    inflight: int,
    device: str,
    abort_rate: float,
    kill_prefill_after: int | None,
    lease: float | None,
    room_ttl: float | None,
    timeout: float,
    hold: float,
    seed: int | None,
    as_json: bool,
    listen: str | None,
    worker: str | None,
    engine: str | None,
    router: str | None,
) -> None:
    """Run a real disaggregated transfer end to end: Redis state, UCX bytes, every byte
    verified, every key gone. Exit 0 only if all of that held; 130 / 143 when stopped by
    SIGINT / SIGTERM (rooms in flight cleared, partial summary printed)."""
    url, namespace = _inherit(ctx, url, namespace)
    if worker is not None:
        ctx.exit(_attached(worker, engine, router, url, namespace))
    lo, hi = _pages_range(pages_per_request)
    pb = _size(page_bytes)
    if hi > pool_pages:
        raise click.BadParameter(
            f"{hi} pages per request do not fit a pool of {pool_pages}",
            param_hint="--pages-per-request",
        )
    if kill_prefill_after is not None and prefill_workers < 2:
        raise click.UsageError("--kill-prefill-after needs --prefill-workers 2 or more")
    if listen:
        with _errors(url):
            authkey()
    else:  # the workers are this process's children: they need UCX here
        _require_ucx()
    killing = kill_prefill_after is not None
    lease = lease if lease is not None else (KILL_LEASE if killing else LEASE)
    room_ttl = room_ttl if room_ttl is not None else (KILL_ROOM_TTL if killing else DEMO_ROOM_TTL)
    if hold:
        timeout = max(timeout, hold + 30.0)
        room_ttl = max(room_ttl, hold + 60.0)
    if device == "cuda":
        with _errors(url):
            cuda_backend()
    opts = Options(
        n_requests,
        prefill_workers,
        decode_workers,
        lo,
        hi,
        inflight,
        abort_rate,
        kill_prefill_after,
        seed,
        listen,
    )
    with _errors(url):
        code = run_router(
            opts,
            url,
            namespace or f"demo-{secrets.token_hex(3)}",
            WorkerConfig(
                "", "", pb, pool_pages, layers, device, lease, room_ttl, timeout, hold=hold
            ),
            as_json,
        )
    ctx.exit(code)


def _attached(
    role: str, engine: str | None, router: str | None, url: str | None, namespace: str | None
) -> int:
    """``--worker``: one worker attached to a router elsewhere; returns the exit status."""
    if not engine or not router:
        raise click.UsageError("--worker needs --engine and --router")
    with _errors(url):
        authkey()
        _require_ucx()
        got = run_worker(role, engine, router, url, namespace)
    return 128 + got if got else 0


def _inherit(
    ctx: click.Context, url: str | None, namespace: str | None
) -> tuple[str | None, str | None]:
    """Under ``kvstate demo`` the group's --url/--namespace count too."""
    parent = ctx.parent
    if parent is not None:
        url = url or parent.params.get("url")
        src = parent.get_parameter_source("namespace")
        if namespace is None and src is not None and src.name != "DEFAULT":
            namespace = parent.params.get("namespace")
    url = url or os.environ.get(ENV_URL) or None
    namespace = namespace or os.environ.get(ENV_NAMESPACE) or None
    return url, namespace
