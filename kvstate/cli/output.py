"""How the ``kvstate`` command prints: rich tables on stdout, JSON for scripts."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import click
from rich.console import Console
from rich.text import Text


class _Console(Console):
    """Rich's console; when not a terminal, each line without the spaces rich pads table
    cells with (a pipe or a file gets no trailing blanks)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.is_terminal:
            super().print(*objects, **kwargs)
            return
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        self.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


def console() -> Console:
    """Rich output on stdout; wide when piped so keys are not cut. Markup is off: engine
    names, reasons and URLs are printed as written (``[`` and ``]`` are legal in them);
    styles come from Text objects only."""
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return _Console(width=width, highlight=False, soft_wrap=False, markup=False)


# Output is bounded whatever Redis holds (issue 30: a 1 MB reason, a 20k-field hash, a
# 200k-entry trace): a stored value shows at most this much, cut with what is left.
TEXT_CELL = 200  # characters of one stored value in a table cell or a line
JSON_TEXT = 4096  # characters of one string in --json
JSON_ENTRIES = 200  # entries of one object (a stored hash's fields...) in --json
ROWS = 1000  # rows of a table or --json list, by default (each command's --limit)


def cut(value: object, n: int = TEXT_CELL) -> str:
    """``value`` as text, at most ``n`` characters and a note of what was cut."""
    text = "" if value is None else str(value)
    return text if len(text) <= n else f"{text[:n]}... ({len(text) - n} more chars)"


def more(n: int, what: str = "") -> str:
    """The line that ends a cut list: ``... 12 more`` (rows, steps, findings...)."""
    return f"... {n} more{' ' + what if what else ''}"


def bounded(doc: Any) -> Any:
    """``doc`` with every string cut to JSON_TEXT and every object to JSON_ENTRIES
    entries (the last one "...": "N more"); lists are each command's to bound."""
    if isinstance(doc, str):
        return cut(doc, JSON_TEXT)
    if isinstance(doc, dict):
        items = list(doc.items())
        out = {cut(k, JSON_TEXT): bounded(v) for k, v in items[:JSON_ENTRIES]}
        if len(items) > JSON_ENTRIES:
            out["..."] = more(len(items) - JSON_ENTRIES)
        return out
    if isinstance(doc, list | tuple):
        return [bounded(v) for v in doc]
    return doc


def styled(text: str, style: str) -> Text:
    return Text(cut(text, max(TEXT_CELL, 600)), style=style)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(bounded(doc), indent=2, sort_keys=False, default=str))


def status_style(status: str) -> str:
    return {
        "Failed": "red",
        "Success": "green",
        "Transferring": "cyan",
        "WaitingForInput": "yellow",
        "Bootstrapping": "yellow",
    }.get(status, "magenta")


def name_width(names: Iterable[str]) -> int:
    """Room for whole engine names in narrow terminals (longer ones wrap, never cut)."""
    return min(20, max((len(n) for n in names), default=6))
