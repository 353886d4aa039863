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

The library's name carries a hash of its text, so two kvstate versions share a server
without clashing and no FUNCTION LOAD REPLACE is ever sent ("already exists" is
fine). No function declares ``no-writes`` (each script may write); without flags
Redis refuses a writing function up front at maxmemory, where EVAL lets the reads of
a script through: the executor then sends that batch by EVAL (kvstate.store.executor).
"""

from __future__ import annotations

import hashlib
import re

import redis
from redis.exceptions import NoPermissionError, ResponseError

from kvstate.store.scripts import BODIES, LIB

_TOP_LOCAL = re.compile(r"^local (\w+) = (.+?)\s*(?:--.*)?$", re.M)


def per_call_state(lib: str) -> dict[str, str]:
    """``_lib.lua``'s top-level locals that a helper assigns (``clock``...): name ->
    its initial value, which each callback restores (state of one script call)."""
    return {
        name: init
        for name, init in _TOP_LOCAL.findall(lib)
        if re.search(rf"^\s+{name}\s*=[^=]", lib, re.M)
    }


def build(lib: str, bodies: dict[str, str]) -> tuple[str, dict[str, str], str]:
    """(library name, script -> function name, library source) of ``bodies``."""
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
    text = "local KEYS, ARGV\n" + "\n".join(parts)
    name = "kvstate_" + hashlib.sha1(text.encode()).hexdigest()[:12]
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


def loaded(reply: object) -> bool:
    """Whether a FUNCTION LOAD reply says the library is on the node now."""
    return not isinstance(reply, Exception) or "already exists" in str(reply)


def node_key(node: redis.Redis) -> tuple[object, ...]:
    """Which server a client talks to, where a Store keeps its FCALL-or-EVAL decision:
    its address, so a Cluster node that takes over a slot (failover, migration) is
    decided afresh."""
    kw = node.connection_pool.connection_kwargs
    return (kw.get("host"), kw.get("port"), kw.get("path"), kw.get("db"))


def load(node: redis.Redis) -> bool:
    """FUNCTION LOAD the library on ``node``; False where the node will not take it
    (Redis 6.2, FUNCTION renamed or refused by the ACL, maxmemory: FUNCTION LOAD is a
    write, unlike SCRIPT LOAD), so that node takes the EVAL path."""
    try:
        node.execute_command("FUNCTION", "LOAD", LIBRARY)  # type: ignore[no-untyped-call]
    except ResponseError as exc:
        return loaded(exc)
    return True
