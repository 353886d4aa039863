"""The ``kvstate`` command (entry point ``kvstate.cli:main``), one module per concept.

``app``: the click group, its context, exit codes and error plumbing; ``output``: how
things print; ``rooms`` (show, ls, abort), ``trace``, ``engines``, ``top``, ``audit``, ``monitor``,
``doctor`` and ``functions`` (the FUNCTION libraries, an admin's): the commands.
Importing a command module registers its command.
"""

from __future__ import annotations

from kvstate.cli import audit, doctor, engines, functions, monitor, rooms, top, trace
from kvstate.cli.app import main
from kvstate.cli.doctor import OPERATOR_ACL, OPERATOR_ACL_7, READER_ACL, READER_ACL_7

__all__ = ["OPERATOR_ACL", "OPERATOR_ACL_7", "READER_ACL", "READER_ACL_7", "main"]
# imported to register them
_COMMANDS = (audit, doctor, engines, functions, monitor, rooms, top, trace)

try:  # the demo's own dependencies missing must not take the operator commands down
    from kvstate.demo import demo as _demo

    main.add_command(_demo)
except ImportError:  # pragma: no cover - an install without the demo's dependencies
    pass
