"""Defaults shared by the API, the CLI, the integrations and the demo: one place each.

Only values that more than one module spells live here; a default that one module
owns (the ledger's TTL, the counters' TTL) stays beside the code that uses it.
"""

from __future__ import annotations

from typing import Final

ROOM_TTL: Final = 900.0  # s: every room key's TTL, the leak backstop
LEASE: Final = 10.0  # s: an engine registration's TTL, renewed by its heartbeat
CALL_TIMEOUT: Final = 8.0  # s: the bound of one public call against a stalled Redis
# s: how long a participant may stay Bootstrapping / WaitingForInput before its poll
# fails it (SGLang's SGLANG_DISAGGREGATION_*_TIMEOUT default to the same)
BOOTSTRAP_TIMEOUT: Final = 300.0
WAITING_TIMEOUT: Final = 300.0
# s: how long a terminal participant may wait for its clear, and an unclaimed transfer
# info for its sender, before the audit counts it (the CLI's --grace)
AUDIT_GRACE: Final = 60.0
# The room trace (`kvstate trace ROOM`): the share of rooms traced (chosen by room id,
# so both sides agree), and how long a trace is kept after its last entry (the room's
# clear included), in s. The demo traces every room.
TRACE_RATE: Final = 0.01
TRACE_TTL: Final = 3600.0
