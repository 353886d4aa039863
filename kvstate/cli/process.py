"""The process side of a command: its log lines, a closed stdout, Ctrl-C and SIGTERM
for live commands, and finding a running ``kvstate demo`` (what `app.py`'s context
uses, kept apart from the click plumbing)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import click

from kvstate.ops.exits import EXIT_OK, EXIT_PIPE_CLOSED
from kvstate.store import ENV_URL, URL_SOURCE

DEMO_RECORD = "kvstate-demo-*.json"  # written by a running `kvstate demo`, removed at exit
CLI_URL_SOURCE = f"--url or ${ENV_URL}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_demo() -> dict[str, Any] | None:
    """The newest discovery record of a live `kvstate demo` of this user: a JSON file
    ``kvstate-demo-<pid>.json`` ({"url", "namespace", "pid"}) in ``$XDG_RUNTIME_DIR``
    (else /tmp). Files of other users are ignored (/tmp is shared)."""
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")  # where the demo writes it
    found: list[tuple[float, dict[str, Any]]] = []
    try:
        paths = list(folder.glob(DEMO_RECORD))
    except OSError:
        paths = []
    for path in paths:
        try:
            st = path.stat()
            if st.st_uid != os.getuid():
                continue
            doc = json.loads(path.read_text())
            pid = int(doc["pid"])
            record = {"url": str(doc["url"]), "namespace": str(doc["namespace"]), "pid": pid}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive(pid):
            found.append((st.st_mtime, record))
    return max(found, key=lambda f: f[0])[1] if found else None


def now_stamp() -> str:
    """This host's time for a log line (UTC, to the second): when it was printed, never
    an age or a deadline (those are the Redis server's, design rule 9)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StderrLines(logging.Handler):
    """kvstate's warnings as the CLI's own lines (``kvstate: warning: ...``), on
    whatever stderr is current (click's test runner swaps it); after the time when
    ``stamped`` (a long-running command's log: ``monitor``)."""

    stamped = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().replace(URL_SOURCE, CLI_URL_SOURCE)  # CLI wording
            line = f"kvstate: {record.levelname.lower()}: {text}"
            click.echo(f"{now_stamp()} {line}" if self.stamped else line, err=True)
        except Exception:  # noqa: BLE001 - a log line must never end a command
            self.handleError(record)


def stamp_log_lines() -> None:
    """From now on the library's warnings this CLI shows start with the time."""
    StderrLines.stamped = True


def log_warnings() -> None:
    """Show the library's warnings (a password the server ignores, a lease renewal
    that failed...) as one line each, when nothing else configured logging."""
    root = logging.getLogger()
    if not root.handlers:
        handler = StderrLines(logging.WARNING)
        root.addHandler(handler)


def pipe_closed() -> NoReturn:
    """stdout's reader went away (``kvstate ls | head``): no traceback, no error line,
    and exit status 141 (128 + SIGPIPE), what a Unix tool killed by SIGPIPE reports
    (click's 1 read as "findings"). Later writes and the flush at exit go nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's runner)
        pass
    sys.exit(EXIT_PIPE_CLOSED)


class Stopper:
    """SIGINT (Ctrl-C) and SIGTERM for a live command (``top``, ``monitor``): either one
    sets ``event``, so the loop ends its step and stops; ``exit_code`` is then 128 + the
    signal (130 / 143, as the demo's), 0 when nothing stopped it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Stopper:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else EXIT_OK
