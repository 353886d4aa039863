"""Every Redis call kvstate makes, and the only package of kvstate that imports redis-py.

Built on redis-py's model, calls apart from their execution: ``calls`` builds them
(pure), ``executor`` runs a batch in one round trip per node over ``wire``'s lean path,
``translate`` turns redis-py's errors into kvstate's under the call's deadline
(``deadline``), ``scripts`` holds the Lua sources and their SHAs, ``admin`` the
server-level reads ops and the CLI need, in kvstate's types. ``core`` puts them
together as ``Store`` and opens one with ``connect()``; ``connection`` parses URLs and
makes clients, ``redispy_private`` is the one place redis-py's private names are
reached, ``redis_server`` and ``embedded`` start a private redis-server, ``plain``
hands launchers, tests and tools plain clients and ``roundtrips`` counts round trips.
"""

from kvstate.store.calls import MARK_MIN_TTL, Call, Status
from kvstate.store.connection import Options
from kvstate.store.core import EMBEDDED, Store, connect, one_call
from kvstate.store.translate import URL_SOURCE

__all__ = [
    "EMBEDDED",
    "MARK_MIN_TTL",
    "URL_SOURCE",
    "Call",
    "Options",
    "Status",
    "Store",
    "connect",
    "one_call",
]
