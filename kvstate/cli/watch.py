"""``--watch PERIOD`` for ``ls`` and ``show``: the same view again every period, until
Ctrl-C (exit 130) or SIGTERM (143), as ``watch kvstate ls`` would, without a new
process (and its start-up) per refresh.

On a terminal each refresh replaces the screen; piped, the snapshots follow each
other, each after a header line with the server time (``--json``: one JSON document
per refresh, no header). A Redis that goes away is said once and waited for, as
``top`` does; one gone for good (a demo's embedded server) ends the watch (exit 2).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NoReturn

import click

from kvstate.cli.app import Ctx, describe
from kvstate.cli.process import Stopper
from kvstate.errors import KVStateError
from kvstate.ops.durations import fmt_ms
from kvstate.ops.exits import CommandError
from kvstate.store import Store


def watching(
    obj: Ctx, store: Store, period: float, what: str, once: Callable[[], object], as_json: bool
) -> NoReturn:
    """Run ``once`` (which prints one view) every ``period`` seconds until a signal."""
    tty = sys.stdout.isatty()
    lost_since: float | None = None
    with Stopper() as stopper:
        while True:
            if tty:
                click.clear()
            if not as_json:
                stamp = datetime.now(UTC).strftime("%H:%M:%S")
                click.echo(
                    f"kvstate {what}: every {fmt_ms(int(period * 1000))}, at {stamp} UTC "
                    "(Ctrl-C stops)"
                )
            try:
                once()
                if lost_since is not None:
                    click.echo(
                        f"kvstate {what}: Redis at {store.url} is back after "
                        f"{fmt_ms(int((time.monotonic() - lost_since) * 1000))}",
                        err=True,
                    )
                    lost_since = None
            except KVStateError as exc:
                why = obj.gone()
                if why is not None:
                    raise CommandError(why) from None
                if lost_since is None:
                    lost_since = time.monotonic()
                    click.echo(
                        f"kvstate {what}: {describe(exc)}; retrying (Ctrl-C stops)", err=True
                    )
            sys.stdout.flush()
            if stopper.wait(period):
                break
    sys.exit(stopper.exit_code)
