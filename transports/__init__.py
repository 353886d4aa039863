"""KV page transports: move pages between processes, knowing nothing of Redis.

``transports.base`` holds the contract (``Transport``, ``Target``, errors);
``transports.pages`` and ``transports.cma`` need only numpy; ``transports.ucx``, the
UCX implementation, needs the ``ucx`` extra (``pip install 'kvstate[ucx]'``): import it
on demand, where a transport is wanted.
"""

from transports.base import (
    Geometry,
    Heads,
    LayoutError,
    Target,
    Transport,
    TransportError,
    TransportStats,
)

__all__ = [
    "Geometry",
    "Heads",
    "LayoutError",
    "Target",
    "Transport",
    "TransportError",
    "TransportStats",
]
