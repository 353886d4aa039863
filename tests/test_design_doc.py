"""docs/design.md stays true line by line where a machine can tell (issue 32): every file
and folder it names exists, every dotted name it gives (``kvstate.tp``,
``Store.clear_many``, ``transports.base.Heads``) resolves, and every call it writes as
``name()`` is a function, method or script that exists."""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import kvstate
import transports

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
TOKEN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w./*-]+(\.py|\.lua|/)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?$")
CALL = re.compile(r"^([A-Za-z_]\w*)\(")


def tokens() -> list[str]:
    text = DESIGN.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # the API block is run by tests
    return TOKEN.findall(text)


@functools.cache
def _modules() -> list[ModuleType]:
    out: list[ModuleType] = []
    for pkg in (kvstate, transports):
        out.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".integrations." in info.name or info.name.startswith("transports.ucx"):
                continue  # optional installs: their names are checked by their own tests
            if info.name.endswith("__main__"):
                continue  # running it is what importing it does
            out.append(importlib.import_module(info.name))
    return out


def _names() -> set[str]:
    """Every function, class, method and attribute name defined in kvstate/transports,
    and every Lua script name (a script is a call too: ``take_trace()``)."""
    names: set[str] = set()
    for mod in _modules():
        for name, obj in vars(mod).items():
            names.add(name)
            if inspect.isclass(obj):
                names.update(vars(obj))
    lua = (ROOT / "kvstate" / "scripts").glob("*.lua")
    for path in lua:
        names.add(path.stem)
        names.update(re.findall(r"local function (\w+)", path.read_text()))
    return names


def test_every_path_it_names_exists() -> None:
    missing = []
    for t in tokens():
        if not PATH.match(t) or t.startswith(("http", "/", ".")):
            continue
        if "*" in t:
            base = t.split("*")[0]
            found = any(ROOT.glob(t)) or any((ROOT / "kvstate").glob(t)) or (ROOT / base).exists()
        else:
            # a path as written (from the repo root), or short as design.md writes it
            # inside a paragraph about its package (``store/``, ``calls.py``)
            found = (
                (ROOT / t).exists()
                or (ROOT / "kvstate" / t).exists()
                or any(
                    p.relative_to(ROOT).as_posix().endswith(t.rstrip("/"))
                    for p in ROOT.glob("**/" + Path(t.rstrip("/")).name)
                    if ".venv" not in p.parts
                )
            )
        if not found:
            missing.append(t)
    assert missing == [], f"design.md names paths that do not exist: {missing}"


def _resolve(dotted: str) -> bool:
    parts = dotted.removesuffix("()").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    # Class.member: the class defined (or imported) by any module of kvstate/transports
    for mod in _modules():
        obj = mod
        ok = True
        for attr in parts:
            if not hasattr(obj, attr):
                ok = False
                break
            obj = getattr(obj, attr)
        if ok:
            return True
    return False


# dotted words in design.md that are not Python names
NOT_NAMES = {"redis.call", "redis.replicate_commands()", "redis.pcall", "store.one_call"}


def test_every_dotted_name_it_gives_resolves() -> None:
    bad = [
        t
        for t in tokens()
        if DOTTED.match(t)
        and t not in NOT_NAMES
        and not t.endswith((".py", ".lua", ".md", ".toml"))
        and t.split(".")[0] not in {"snd", "rcv", "mgr", "dmgr", "p", "store", "info"}
        and not _resolve(t)
    ]
    assert bad == [], f"design.md gives names that do not resolve: {bad}"


def test_every_call_it_writes_exists() -> None:
    names = _names()
    builtins = {"sprintf", "repr"}  # C's and Python's
    bad = sorted(
        {
            m.group(1)
            for t in tokens()
            if (m := CALL.match(t)) and m.group(1) not in names and m.group(1) not in builtins
        }
    )
    assert bad == [], f"design.md writes calls that exist nowhere: {bad}"


@pytest.mark.parametrize(
    ("planted", "check"),
    [
        ("`kvstate/nowhere.py`", "test_every_path_it_names_exists"),
        ("`kvstate.tp.no_such_name`", "test_every_dotted_name_it_gives_resolves"),
        ("`no_such_call()`", "test_every_call_it_writes_exists"),
    ],
)
def test_each_check_fails_on_a_planted_line(
    planted: str, check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = DESIGN.read_text() + f"\n{planted}\n"
    monkeypatch.setattr("tests.test_design_doc.tokens", lambda: TOKEN.findall(text))
    with pytest.raises(AssertionError, match=re.escape(planted.strip("`").removesuffix("()"))):
        globals()[check]()
