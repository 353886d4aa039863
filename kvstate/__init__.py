"""kvstate: per-room KV-transfer state for disaggregated LLM serving, kept in Redis."""

from kvstate.codec import TransferInfo
from kvstate.errors import (
    ClosedError,
    CorruptStateError,
    DurabilityError,
    EngineNameTakenError,
    ForkedManagerError,
    InvalidArgumentError,
    InvalidIndicesError,
    InvalidNameError,
    InvalidOptionError,
    InvalidRoomError,
    InvalidStatusError,
    InvalidURLError,
    InvalidValueError,
    KVStateError,
    KVTransferError,
    ManagerClosedError,
    NotReadyError,
    PeerNotFoundError,
    PermissionDeniedError,
    StateConnectionError,
    StateOutOfMemoryError,
)
from kvstate.poll import KVPoll, PollResults
from kvstate.roles import KVManager, KVReceiver, KVSender
from kvstate.store import Options, Store, connect

__version__ = "0.1.0"

__all__ = [
    "ClosedError",
    "CorruptStateError",
    "DurabilityError",
    "EngineNameTakenError",
    "ForkedManagerError",
    "InvalidArgumentError",
    "InvalidIndicesError",
    "InvalidNameError",
    "InvalidOptionError",
    "InvalidRoomError",
    "InvalidStatusError",
    "InvalidURLError",
    "InvalidValueError",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVStateError",
    "KVTransferError",
    "ManagerClosedError",
    "NotReadyError",
    "Options",
    "PeerNotFoundError",
    "PermissionDeniedError",
    "PollResults",
    "StateConnectionError",
    "StateOutOfMemoryError",
    "Store",
    "TransferInfo",
    "connect",
]
