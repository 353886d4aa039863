"""The private redis-server used when no URL is given (docs/design.md, Zero setup).

Started once per process tree on a unix socket in a temporary directory; its URL
goes into ``$KVSTATE_REDIS_URL`` so spawned workers share it; it stops when the
process that started it exits (and dies with it on SIGKILL).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from kvstate.connection import ENV_URL
from kvstate.redis_server import RedisServer

log = logging.getLogger(__name__)
_lock = threading.Lock()
_server: RedisServer | None = None


def ensure_server() -> str:
    """URL of this process tree's embedded Redis, starting it on first use."""
    global _server
    with _lock:
        if _server is None:
            # PR_SET_PDEATHSIG follows the starting *thread*: only tie the server's life
            # to the main thread's; elsewhere the atexit hook alone stops it.
            main = threading.current_thread() is threading.main_thread()
            proc = RedisServer(unix_socket=True, die_with_parent=main)
            proc.start()
            owner = os.getpid()

            def stop() -> None:
                if os.getpid() == owner:
                    proc.stop()

            atexit.register(stop)
            _server = proc
            os.environ[ENV_URL] = proc.url
            log.info("started embedded redis-server at %s", proc.url)
        return _server.url
