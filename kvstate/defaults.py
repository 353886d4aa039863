"""Defaults shared by the API, the CLI, the integrations and the demo: one place each."""

from __future__ import annotations

from typing import Final

ROOM_TTL: Final = 900.0  # s: every room key's TTL, the leak backstop
LEASE: Final = 10.0  # s: an engine registration's TTL, renewed by its heartbeat
CALL_TIMEOUT: Final = 8.0  # s: the bound of one public call against a stalled Redis
