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


def styled(text: str, style: str) -> Text:
    return Text(text, style=style)


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


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
