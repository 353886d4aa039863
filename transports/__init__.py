"""KV page transports: move pages between processes, knowing nothing of Redis.

``transports.base`` holds the contract (``Transport``, ``Target``, errors);
``transports.ucx`` the UCX implementation (imported on demand: it starts UCX).
"""

from transports.base import LayoutError, Target, Transport, TransportError, TransportStats

__all__ = ["LayoutError", "Target", "Transport", "TransportError", "TransportStats"]
