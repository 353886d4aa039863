"""The stored vocabulary: hash field names and member formats of kvstate's keys.

Key *names* are built in ``kvstate.keys``; what goes *inside* the keys is spelled here
and mirrored by the constants at the top of ``kvstate/scripts/_lib.lua`` (a test holds
the two together). Change a field in these two files, nowhere else.
"""

from __future__ import annotations

from typing import Final

# -- participant hash: kvstate:<ns>:{<room>}:<side>:<engine> ---------------------------
STATUS: Final = "status"  # a KVPoll name
SINCE_MS: Final = "since_ms"  # server ms of the last status change
REASON: Final = "reason"  # text, set with Failed
PEERS: Final = "peers"  # senders a receiver waits for / receivers a sender serves
PEER_ADDR: Final = "peer_addr"  # the other side's bootstrap address
BOOTSTRAP_TIMEOUT_MS: Final = "bootstrap_timeout_ms"
WAITING_TIMEOUT_MS: Final = "waiting_timeout_ms"
INFOS_V: Final = "infos_v"  # sender: publishes addressed to it so far
BOUND: Final = "bound"  # receiver: senders bound so far
PEER_PREFIX: Final = "peer:"  # receiver: peer:<engine> -> that engine's incarnation

# -- engine registration hash: kvstate:<ns>:engine:<engine> ----------------------------
INCARNATION: Final = "incarnation"
HOST: Final = "host"
PID: Final = "pid"

# -- parts hash: kvstate:<ns>:{<room>}:parts, member "<side>:<engine>" -> created ms ----
CREATED_MS: Final = "created_ms"


def peer_field(engine: str) -> str:
    return f"{PEER_PREFIX}{engine}"
