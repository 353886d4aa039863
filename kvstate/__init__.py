"""kvstate: per-room KV-transfer state for disaggregated LLM serving, kept in Redis."""

import importlib
from typing import TYPE_CHECKING, Any

from kvstate.errors import (
    AuthenticationFailedError,
    ClosedError,
    CorruptStateError,
    DurabilityError,
    DurationSyntaxError,
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
    LayoutRefusedError,
    ManagerClosedError,
    MetricsPortError,
    NotReadyError,
    PeerNotFoundError,
    PermissionDeniedError,
    RedisServerError,
    StateConnectionError,
    StateOutOfMemoryError,
    UnsupportedConfigError,
    UnsupportedLayoutError,
    UnsupportedSGLangError,
    VLLMConfigError,
)
from kvstate.poll import KVPoll, PollResults
from kvstate.store import Options, Store, connect

if TYPE_CHECKING:
    from kvstate.codec import TransferInfo
    from kvstate.errors import CMAError, LayoutError, PtracerError, TransportError
    from kvstate.roles import KVManager, KVReceiver, KVSender

# Loaded on first use (PEP 562): the roles, the codec and the transports' errors bring
# numpy and the transport layer, which `kvstate ls` never needs (issue 31: start-up).
_LAZY = {
    "TransferInfo": "kvstate.codec",
    "KVManager": "kvstate.roles",
    "KVReceiver": "kvstate.roles",
    "KVSender": "kvstate.roles",
    "CMAError": "kvstate.errors",
    "LayoutError": "kvstate.errors",
    "PtracerError": "kvstate.errors",
    "TransportError": "kvstate.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "AuthenticationFailedError",
    "CMAError",
    "ClosedError",
    "CorruptStateError",
    "DurabilityError",
    "DurationSyntaxError",
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
    "LayoutError",
    "LayoutRefusedError",
    "ManagerClosedError",
    "MetricsPortError",
    "NotReadyError",
    "Options",
    "PeerNotFoundError",
    "PermissionDeniedError",
    "PollResults",
    "PtracerError",
    "RedisServerError",
    "StateConnectionError",
    "StateOutOfMemoryError",
    "Store",
    "TransferInfo",
    "TransportError",
    "UnsupportedConfigError",
    "UnsupportedLayoutError",
    "UnsupportedSGLangError",
    "VLLMConfigError",
    "connect",
]
