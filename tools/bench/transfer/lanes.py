"""Which UCX transports each system's endpoints used (``--ucx-lanes``).

UCX 1.21 logs, at level ``info``, one line per endpoint configuration it builds: its
lanes by operation, e.g. ``intra-node cfg#0 tag(tcp/lo) rma_am(tcp/lo) am(tcp/lo) ...``
(``rma_am``: puts emulated over active messages; ``rma`` / ``rma_bw``: a transport
that puts itself); with ``UCX_PROTO_INFO=y``, the protocol each operation takes by
message size (``put 0..inf software emulation via tcp/lo``; NIXL's own UCX build logs
these tables, not the lanes line). Each UCX user's processes get both, with
``UCX_LOG_FILE`` in a directory of the run; the lines are read back after it. Rows for
an endpoint to the process itself (``self/memory``) are left out.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tools.bench.transfer.systems import System

UCX_KINDS = ("kvstate", "ucxx", "nixl")
_CFG = re.compile(r"\S+ ((?:intra|inter)-node) cfg#\d+ (\w+\(.*\S)")
_TITLE = re.compile(r"remote memory (write|read) by ucp_(put|get)\*(\([\w-]+\))? from (\w+)")
_ROW = re.compile(r"\|\s*(\d+\.\.\S+)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|")


def logged(system: System, directory: str, mode: str) -> System:
    """``system`` with UCX's info log going to a file of its own (UCX users only)."""
    if system.kind not in UCX_KINDS:
        return system
    env = {
        "UCX_LOG_LEVEL": "info",
        "UCX_PROTO_INFO": "y",
        "UCX_LOG_FILE": f"{directory}/{mode}.{system.key}.%p.log",
    }
    return dataclasses.replace(system, env=system.env | env)


def read(directory: str) -> dict[str, dict[str, list[str]]]:
    """mode -> system -> the distinct endpoint configurations and put/get protocols its
    processes logged."""
    out: dict[str, dict[str, list[str]]] = {}
    for path in sorted(Path(directory).glob("*.log")):
        mode, key = path.name.split(".")[:2]
        found = out.setdefault(mode, {}).setdefault(key, [])
        op = ""
        for line in path.read_text(errors="replace").splitlines():
            seen = ""
            if m := _CFG.search(line):
                seen, op = f"{m[1]} {m[2]}", ""
            elif m := _TITLE.search(line):
                op = f"{m[2]}{m[3] or ''} from {m[4]}"
            elif m := _ROW.search(line):
                if op and "self/" not in m[3]:
                    seen = f"{op}: {m[1]} {m[2]} via {m[3]}"
            elif "|" in line and "Range" not in line:  # another operation's table
                op = ""
            if seen and seen not in found:
                found.append(seen)
    return out
