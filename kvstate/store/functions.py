"""The Lua scripts as one Redis 7 FUNCTION library, and how a node is told to use it.

On Redis >= 7.0 every script runs as a function (FCALL): Redis no longer runs the
``_lib.lua`` preamble on every call (its RANK table, a closure per helper), as it does
for each EVALSHA (9-10% of Redis command time per lifecycle: tools/bench_state.py).
The library is generated here from the same ``kvstate/scripts/*.lua`` files (no
second copy of any Lua): ``_lib.lua`` once at
library level, its helpers made once at load instead of per call, and each script's
body as the callback of ``kvstate_<hash>_<script>``. Functions see no globals, so the
library declares ``KEYS``, ``ARGV`` and ``_lib.lua``'s per-call state (``clock``,
``trace_key``...: the locals a helper assigns) as library locals, and each callback sets
them first thing; a script's body and the helpers then read them as they do under
EVAL. Redis runs one call at a time, so nothing leaks between calls.

The library's name carries a hash of its text (kvstate's version included, in its
header comment), so two kvstate versions share a server without clashing and no
FUNCTION LOAD REPLACE is ever sent. A name proves nothing, though: whoever may FUNCTION
LOAD can load a library of that name first, or replace it, and FCALL runs whatever it
holds with the caller's rights (issue 30). So a node runs the scripts by FCALL only
once ``FUNCTION LIST LIBRARYNAME <name> WITHCODE`` showed this exact text there
(``verified``); "already exists" means nothing. Anything else takes the EVAL path,
whose scripts are named by the SHA-1 of their text (content-addressed). No function
declares ``no-writes`` (each script may write); without flags Redis refuses a writing
function up front at maxmemory, where EVAL lets the reads of a script through: the
executor then sends that batch by EVAL (kvstate.store.executor).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import metadata

import redis
from redis.exceptions import NoPermissionError, ResponseError

from kvstate.store.scripts import BODIES, LIB

PREFIX = "kvstate_"  # every kvstate library's name starts with it
_VERSION_LINE = re.compile(r"^-- kvstate (\S+)", re.M)
_TOP_LOCAL = re.compile(r"^local (\w+) = (.+?)\s*(?:--.*)?$", re.M)


def per_call_state(lib: str) -> dict[str, str]:
    """``_lib.lua``'s top-level locals that a helper assigns (``clock``...): name ->
    its initial value, which each callback restores (state of one script call)."""
    return {
        name: init
        for name, init in _TOP_LOCAL.findall(lib)
        if re.search(rf"^\s+{name}\s*=[^=]", lib, re.M)
    }


def _version() -> str:
    try:
        return metadata.version("kvstate")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


VERSION = _version()


def build(
    lib: str, bodies: dict[str, str], version: str = VERSION
) -> tuple[str, dict[str, str], str]:
    """(library name, script -> function name, library source) of ``bodies``; the
    source's first comment names the kvstate ``version`` that loads it (what `kvstate
    doctor` shows of a library on a server)."""
    # Redis 7 replicates effects always; the call is EVAL-only (absent in functions)
    lib = re.sub(r"^redis\.replicate_commands\(\).*\n", "", lib, flags=re.M)
    state = per_call_state(lib)
    reset = ", ".join(["KEYS", "ARGV", *state]) + " = keys, argv"
    if state:
        reset += ", " + ", ".join(state.values())
    parts = [lib]
    for script, body in bodies.items():
        parts.append(
            f"redis.register_function{{function_name = '@{script}', "
            f"callback = function(keys, argv)\n{reset}\n{body}\nend}}\n"
        )
    text = f"-- kvstate {version}\nlocal KEYS, ARGV\n" + "\n".join(parts)
    name = PREFIX + hashlib.sha1(text.encode()).hexdigest()[:12]
    text = text.replace("function_name = '@", f"function_name = '{name}_")
    return name, {s: f"{name}_{s}" for s in bodies}, f"#!lua name={name}\n{text}"


NAME, FUNCTIONS, LIBRARY = build(LIB, BODIES)


def invocation(script: str) -> tuple[str, str]:
    """The head of a command that runs script ``script``: FCALL of its function."""
    return ("FCALL", FUNCTIONS[script])


def not_found(reply: object) -> bool:
    """The node lacks the library (restart, FUNCTION FLUSH, failover, slot moved)."""
    return isinstance(reply, ResponseError) and str(reply).startswith("Function not found")


def refused(reply: object) -> bool:
    """FCALL or FUNCTION cannot run on this node: unknown (Redis 6.2; renamed or
    disabled) or not allowed by the ACL (NOPERM naming the command, not a key)."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply).lower()
    named = "fcall" in text or "function" in text
    unknown = text.startswith("unknown command") or text.startswith("unknown subcommand")
    return named and (unknown or (isinstance(reply, NoPermissionError) and "command" in text))


# FUNCTION LIST of this library with its code: what ``verified`` reads
LIST = ("FUNCTION", "LIST", "LIBRARYNAME", NAME, "WITHCODE")


@dataclass(frozen=True)
class Library:
    """A FUNCTION library on a node, as FUNCTION LIST ... WITHCODE shows it."""

    name: str
    code: str
    functions: tuple[str, ...]

    @property
    def version(self) -> str:
        """The kvstate version its header names ('?' when none: not kvstate's text)."""
        found = _VERSION_LINE.search(self.code[:400])
        return found[1] if found else "?"

    @property
    def current(self) -> bool:
        """This kvstate's own library, with its exact code."""
        return self.name == NAME and self.code == LIBRARY


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _pairs(entry: object) -> dict[str, object]:
    """A FUNCTION LIST entry (a flat [name, value, ...] list in RESP2, a map in RESP3)."""
    if isinstance(entry, dict):
        return {_text(k): v for k, v in entry.items()}
    if not isinstance(entry, list | tuple) or len(entry) % 2:
        return {}
    return {_text(entry[i]): entry[i + 1] for i in range(0, len(entry), 2)}


def libraries(reply: object) -> list[Library]:
    """The libraries of a FUNCTION LIST ... WITHCODE reply ([] for an error reply)."""
    if not isinstance(reply, list):
        return []
    out = []
    for entry in reply:
        doc = _pairs(entry)
        fns = doc.get("functions")
        names = tuple(
            _text(_pairs(f).get("name", "")) for f in (fns if isinstance(fns, list) else [])
        )
        name, code = _text(doc.get("library_name", "")), _text(doc.get("library_code", ""))
        out.append(Library(name, code, names))
    return out


def verified(reply: object) -> bool:
    """Whether a reply to ``LIST`` shows this kvstate's library on the node with its
    exact code: only then may the node run the scripts by FCALL. Function names are
    unique on a server, so a library of this name and text owns every function FCALL
    names. An error reply (Redis 6.2, the ACL refusing FUNCTION LIST), no library, or
    one of this name with other code (loaded by someone else first, or replaced) is
    not."""
    found = libraries(reply)
    return len(found) == 1 and found[0].current


def node_key(node: redis.Redis) -> tuple[object, ...]:
    """Which server a client talks to, where a Store keeps its FCALL-or-EVAL decision:
    its address, so a Cluster node that takes over a slot (failover, migration) is
    decided afresh."""
    kw = node.connection_pool.connection_kwargs
    return (kw.get("host"), kw.get("port"), kw.get("path"), kw.get("db"))


def _call(node: redis.Redis, *args: object) -> object:
    try:
        return node.execute_command(*args)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        return exc


def load(node: redis.Redis) -> bool:
    """Whether ``node`` runs the scripts by FCALL: its library is this exact code
    (``verified``), found there or loaded now. FUNCTION LOAD only when no library of
    that name is there, and only where the user may (an admin's: `kvstate functions
    load`; an engine user of docs/security.md's line may not, and its refusal is all it
    costs); False (the EVAL path) on Redis 6.2, FUNCTION renamed or refused by the
    ACL, at maxmemory (FUNCTION LOAD is a write), or when the library there holds
    other code."""
    listed = _call(node, *LIST)
    if verified(listed):
        return True
    if isinstance(listed, Exception) or libraries(listed):
        return False  # no FUNCTION (6.2, renamed, the ACL), or not our code: EVAL
    _call(node, "FUNCTION", "LOAD", LIBRARY)
    return verified(_call(node, *LIST))
