"""Only kvstate/store/ talks to Redis: nothing else in kvstate/ or transports/ imports
redis-py (docs/design.md, Layers), and no module of the store outgrows one concept
(about 400 lines). Read from the source, no server."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "kvstate" / "store"
MAX_LINES = 420  # "about 400": a module past it holds two things; split it


def _imports_redis(path: Path) -> list[int]:
    """Lines of ``path`` that import redis-py (``import redis...``, ``from redis...``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "redis" or n.startswith("redis.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_store_imports_redis() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for top in ("kvstate", "transports")
        for path in sorted((ROOT / top).rglob("*.py"))
        if STORE not in path.parents
        for line in _imports_redis(path)
    }
    assert not found, f"redis-py imported outside kvstate/store/: {sorted(found)}"


def test_the_store_does_import_redis() -> None:
    """The scan above finds what it looks for (a scan that found nothing anywhere
    would pass for the wrong reason)."""
    assert _imports_redis(STORE / "executor.py")


def test_no_store_module_outgrows_one_concept() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in STORE.glob("*.py")}
    assert sizes, "no kvstate/store/*.py found"
    big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not big, f"kvstate/store/ modules over {MAX_LINES} lines: {big}"
