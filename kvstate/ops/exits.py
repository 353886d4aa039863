"""How kvstate's commands end (the CLI and ``kvstate demo`` alike): their exit statuses,
and the one clear line an error prints."""

from __future__ import annotations

import signal
from typing import Any

import click

EXIT_OK = 0
EXIT_FINDINGS = 1  # findings reported, or nothing found
EXIT_ERROR = 2  # an error, printed as one line that says what to do next
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE  # 141: stdout's reader went away


class CommandError(click.ClickException):
    """One clear line on stderr (``<prog>: error: ...``), exit status 2."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, prog: str = "kvstate") -> None:
        super().__init__(message)
        self.prog = prog

    def show(self, file: Any = None) -> None:
        click.echo(f"{self.prog}: error: {self.format_message()}", err=True)


__all__ = ["EXIT_ERROR", "EXIT_FINDINGS", "EXIT_OK", "EXIT_PIPE_CLOSED", "CommandError"]
