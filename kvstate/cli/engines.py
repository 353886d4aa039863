"""``kvstate engines``: the registry, one row per engine holding a lease."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from kvstate.cli.app import Ctx, common, empty_json, empty_namespace_note, main, opened
from kvstate.cli.output import console, emit_json, name_width
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import EXIT_FINDINGS, EXIT_OK
from kvstate.ops.views import Census, scan_participants
from kvstate.registry import EngineInfo, Registry


def _engine_json(e: EngineInfo, census: Census) -> dict[str, Any]:
    return {
        "engine": e.engine,
        "role": e.role,
        "addr": e.addr,
        "incarnation": e.incarnation,
        "lease_left_ms": e.lease_left_ms,
        "endpoint_bytes": len(e.endpoint),
        "endpoint_kind": str(e.layout.get("transport", "none")) if e.endpoint else "none",
        "buffers": len(e.layout.get("buffers", []) or []),
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
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def engines(obj: Ctx, as_json: bool) -> None:
    """Registered engines: lease left, rooms in flight (by side and status, from the
    census `top` counts), endpoint, incarnation, host, GPUs. Exit status 1 when the
    namespace holds no kvstate key at all."""
    with opened(obj) as store:
        infos = Registry(store).all()
        census = Census.of(scan_participants(store)) if infos else Census()
        note = None if infos else empty_namespace_note(store)
        extra = empty_json(store, note) if note and as_json else {}
    docs = [_engine_json(e, census) for e in infos]
    if as_json:
        emit_json({"engines": docs, **extra})
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
    out = console()
    if not docs:
        out.print(note or "no engines registered (none holds a lease)")
        sys.exit(EXIT_FINDINGS if note else EXIT_OK)
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
    for d in docs:
        gpus = ", ".join(f"{g.get('index')}:{g.get('name')}" for g in d["gpus"]) or "-"
        t.add_row(
            d["engine"],
            d["role"],
            d["addr"],
            d["incarnation"],
            fmt_ms(d["lease_left_ms"]),
            _load_text(d["inflight"]),
            f"{d['endpoint_kind']} ({d['endpoint_bytes']} B, {d['buffers']} buffers)",
            f"{d['host']}:{d['pid']}",
            gpus,
        )
    out.print(t)
