"""The ``kvstate`` command (entry point ``kvstate.cli:main``), one module per concept.

``app``: the click group, its context, exit codes and error plumbing; ``process``: log
lines, a closed stdout, signals, a running demo; ``output``: how things print;
``rooms`` (show, ls), ``abort``, ``trace``, ``engines``, ``top``, ``audit``,
``monitor``, ``doctor`` and ``functions`` (the FUNCTION libraries, an admin's): the
commands. A command's module is imported when that command runs
(``app.COMMANDS``): `kvstate ls` loads neither the monitor's Prometheus client nor the
demo's transport and numpy (issue 31: start-up per call). Importing a command module
registers its command.
"""

from __future__ import annotations

from typing import Any

from kvstate.cli.app import main

_ACL_LINES = ("OPERATOR_ACL", "OPERATOR_ACL_7", "READER_ACL", "READER_ACL_7")
__all__ = [*_ACL_LINES, "main"]


def __getattr__(name: str) -> Any:
    """The ACL lines ``kvstate doctor`` prints, loaded with it on first use."""
    if name in _ACL_LINES:
        from kvstate.cli import doctor

        return getattr(doctor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
