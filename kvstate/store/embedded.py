"""The private redis-server a caller asks for by name: ``connect("embedded")``, the demo
(docs/design.md, Zero setup). Never a fallback for a missing URL.

Started once per process (a fork shares its parent's) on a unix socket in a temporary
directory; it stops when the process that started it exits (and dies with it on
SIGKILL). Processes that must share it are given its URL explicitly (``ensure_server()``
answers it); the environment is left as it was.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from kvstate.store.redis_server import RedisServer

log = logging.getLogger(__name__)
_lock = threading.Lock()
_server: RedisServer | None = None


def ensure_server() -> str:
    """URL of this process's embedded Redis (unix socket, no secret in it), starting it
    on first use."""
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
            log.info("started embedded redis-server at %s", proc.url)
        return _server.url
