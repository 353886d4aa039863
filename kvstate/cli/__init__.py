"""The ``kvstate`` command (entry point ``kvstate.cli:main``)."""

from __future__ import annotations

from kvstate.cli.app import OPERATOR_ACL, main

__all__ = ["OPERATOR_ACL", "main"]
