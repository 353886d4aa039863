"""The Lua scripts: their sources, SHAs, loading, and how a call names one.

Each script is its ``kvstate/scripts/<name>.lua`` after ``_lib.lua``'s preamble and the
helpers it uses. On Redis 7 the same files make one FUNCTION library instead
(kvstate.store.functions); this is the EVAL path, taken where a node cannot run it
(Redis 6.2, FUNCTION renamed or refused by the ACL). It runs a script by EVALSHA;
after NOSCRIPT (server restart, failover, SCRIPT FLUSH) the executor sends the batch
again with EVAL of the source, which cannot meet NOSCRIPT, so a batch must be safe
to send twice: every script is idempotent.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

SCRIPT_NAMES = (
    "create",
    "poll",
    "update",
    "begin",
    "publish",
    "finish",
    "abort",
    "fail_bound",
    "track",
    "register",
    "index",
    "trace",
    "hold",
)
# Durable mode (Options.durable): the scripts whose answer a caller acts on for good (a
# sender's Success, an abort) are confirmed by a replica (WAIT) in the same round trip.
DURABLE_SCRIPTS = frozenset({"finish", "abort"})

_LUA_FUNCTION = re.compile(r"^local function (\w+)\(.*?^end$\n?", re.M | re.S)


def with_lib(lib: str, body: str) -> str:
    """``body`` after ``_lib.lua``'s preamble and only the helpers it uses (directly or
    through another helper): Redis runs the whole source on every call, and each helper
    defined is a closure made per call (~0.3 us each on Redis 7.0)."""
    helpers: list[tuple[str, str]] = []  # (name, source with the comments above it)
    preamble, at = "", 0
    for match in _LUA_FUNCTION.finditer(lib):
        if not helpers:
            preamble = lib[: lib.rfind("\n\n", 0, match.start()) + 1]
            at = len(preamble)
        helpers.append((match[1], lib[at : match.end()]))
        at = match.end()
    if not helpers:
        return lib + "\n" + body
    used: set[str] = set()
    text = body
    for name, source in reversed(helpers):  # a helper uses only those defined above it
        if re.search(rf"\b{name}\b", text):
            used.add(name)
            text += source
    kept = "".join(source for name, source in helpers if name in used)
    return preamble + kept + lib[at:] + "\n" + body


_FOLDER = resources.files("kvstate") / "scripts"
LIB = (_FOLDER / "_lib.lua").read_text()
BODIES = {name: (_FOLDER / f"{name}.lua").read_text() for name in SCRIPT_NAMES}
SOURCES = {name: with_lib(LIB, body) for name, body in BODIES.items()}
SHAS = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in SOURCES.items()}


def invocation(name: str, source: bool) -> tuple[Any, ...]:
    """The head of a command that runs script ``name``: EVALSHA, or (``source``) EVAL
    of its source. After NOSCRIPT, EVAL the source (which caches it again) rather than
    SCRIPT LOAD then EVALSHA: another SCRIPT FLUSH (or a failover) can land between
    those two, and EVAL cannot meet NOSCRIPT."""
    return ("EVAL", SOURCES[name]) if source else ("EVALSHA", SHAS[name])


def is_noscript(reply: object) -> bool:
    """Whether a reply is NOSCRIPT: the script is not cached on that server."""
    return isinstance(reply, NoScriptError)


def load(nodes: Iterable[redis.Redis]) -> None:
    """SCRIPT LOAD every script on every node given, one pipeline per node."""
    for node in nodes:
        pipe = node.pipeline(transaction=False)
        for source in SOURCES.values():
            pipe.script_load(source)
        pipe.execute()
