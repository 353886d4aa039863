"""``kvstate engines``: the registry, one row per engine holding a lease."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from kvstate.cli.app import Ctx, common, empty_json, empty_namespace_note, main, opened
from kvstate.cli.output import ROWS, console, cut, emit_json, more, name_width, styled
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK
from kvstate.ops.views import Census, scan_participants
from kvstate.registry import EngineInfo, Registry


def _engine_json(e: EngineInfo, census: Census) -> dict[str, Any]:
    buffers = e.layout.get("buffers")
    return {
        "engine": e.engine,
        "role": e.role,
        "addr": e.addr,
        "incarnation": e.incarnation,
        "lease_left_ms": e.lease_left_ms,
        "endpoint_bytes": len(e.endpoint),
        "endpoint_kind": str(e.layout.get("transport", "none")) if e.endpoint else "none",
        "buffers": len(buffers) if isinstance(buffers, list) else 0,
        "host": e.host,
        "pid": e.pid,
        "gpus": e.gpus,
        "inflight": census.load_json(e.engine),
    }


def _load_text(load: dict[str, Any]) -> str:
    """``5: tx WaitingForInput 3, tx Transferring 2``; ``0`` when idle."""
    parts = [f"{k.replace(':', ' ', 1)} {n}" for k, n in load["by_status"].items()]
    return f"{load['total']}" + (f": {', '.join(parts)}" if parts else "")


@main.command()
@common
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=ROWS,
    show_default=True,
    help="At most this many engines listed (and as many that do not read).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def engines(obj: Ctx, limit: int, as_json: bool) -> None:
    """Registered engines: lease left, rooms in flight (by side and status, from the
    census `top` counts), endpoint, incarnation, host, GPUs; a registration that does
    not read is named in red. Exit status 1 when one does not, or when the namespace
    holds no kvstate key at all."""
    with opened(obj) as store:
        infos, corrupt = Registry(store).all_read()
        census = Census.of(scan_participants(store)) if infos else Census()
        note = None if infos or corrupt else empty_namespace_note(store)
        extra = empty_json(store, note) if note and as_json else {}
        keys = {e: store.keys.engine(e) for e in corrupt}
    docs = [_engine_json(e, census) for e in infos]
    bad = [{"engine": e, "key": keys[e], "error": why} for e, why in sorted(corrupt.items())]
    code = EXIT_FINDINGS if note or bad else EXIT_OK
    if as_json:
        cuts = {"engines_more": max(0, len(docs) - limit), "corrupt_more": max(0, len(bad) - limit)}
        emit_json({"engines": docs[:limit], "corrupt": bad[:limit], **cuts, **extra})
        sys.exit(code)
    out = console()
    for b in bad[:limit]:  # a registration that does not read: named, and the rest go on
        out.print(styled(f"engine {cut(b['engine'])}: {b['error']}", "red"))
    if len(bad) > limit:
        out.print(more(len(bad) - limit, "registrations that do not read"))
    if not docs:
        out.print(note or "no engines registered (none holds a lease)")
        sys.exit(code)
    t = Table(box=None, header_style="bold")
    for name in (
        "engine",
        "role",
        "addr",
        "incarnation",
        "lease left",
        "in flight",
        "endpoint",
        "host:pid",
        "gpus",
    ):
        t.add_column(
            name,
            overflow="fold" if name in ("engine", "addr", "in flight") else "ellipsis",
            min_width=name_width(d["engine"] for d in docs) if name == "engine" else None,
        )
    for d in docs[:limit]:
        gpus = ", ".join(
            f"{g.get('index')}:{g.get('name')}" if isinstance(g, dict) else str(g)
            for g in d["gpus"][:16]
        )
        t.add_row(
            cut(d["engine"]),
            cut(d["role"]),
            cut(d["addr"]),
            cut(d["incarnation"]),
            fmt_ms(d["lease_left_ms"]),
            _load_text(d["inflight"]),
            cut(f"{d['endpoint_kind']} ({d['endpoint_bytes']} B, {d['buffers']} buffers)"),
            cut(f"{d['host']}:{d['pid']}"),
            cut(gpus) or "-",
        )
    if len(docs) > limit:
        t.add_row(more(len(docs) - limit, "engines (--limit)"))
    out.print(t)
    sys.exit(code)
