"""The stored field names in Lua (constants at the top of kvstate/scripts/_lib.lua) are
kvstate.schema's: a field renamed on one side only would make the scripts and the
Python code read different fields without any error."""

from __future__ import annotations

import re
from importlib import resources

from kvstate import schema

_CONST = re.compile(r"^local F_(\w+) = '([^']*)'$", re.M)


def _lua_constants() -> dict[str, str]:
    lib = (resources.files("kvstate") / "scripts" / "_lib.lua").read_text()
    found = _CONST.findall(lib)
    assert len(found) == len(dict(found)), "a constant is defined twice in _lib.lua"
    return dict(found)


def _schema_constants() -> dict[str, str]:
    return {k: v for k, v in vars(schema).items() if k.isupper() and isinstance(v, str)}


def test_every_lua_constant_equals_the_schema() -> None:
    lua, py = _lua_constants(), _schema_constants()
    assert lua, "no F_ constants found in _lib.lua"
    for name, value in lua.items():
        assert name in py, f"F_{name} in _lib.lua has no kvstate.schema.{name}"
        assert value == py[name], f"F_{name} = {value!r} in Lua, {py[name]!r} in kvstate.schema"


def test_scripts_spell_no_schema_field_as_a_literal() -> None:
    """Outside _lib.lua's constants and comments, a field is named by its constant (so
    a field a script starts to use gets its F_ constant, checked above; kvstate.schema
    also holds fields no script touches: registrations, stats, the ledger)."""
    values = set(_schema_constants().values())
    folder = resources.files("kvstate") / "scripts"
    for entry in folder.iterdir():
        if not entry.name.endswith(".lua"):
            continue
        for n, line in enumerate(entry.read_text().splitlines(), 1):
            code = line.split("--", 1)[0]
            if _CONST.match(line):
                continue
            for literal in re.findall(r"'([^']*)'", code):
                assert literal not in values, f"{entry.name}:{n} spells {literal!r}: use F_"


def test_each_script_carries_only_the_helpers_it_uses() -> None:
    """Redis runs a script's whole source per call: _lib.lua's helpers go only into the
    scripts that call them (directly or through another helper), and every helper a
    script calls is there."""
    from kvstate.store.scripts import SOURCES

    lib = (resources.files("kvstate") / "scripts" / "_lib.lua").read_text()
    all_helpers = re.findall(r"^local function (\w+)\(", lib, re.M)
    for name, source in SOURCES.items():
        defined = re.findall(r"^local function (\w+)\(", source, re.M)
        for helper in defined:
            if helper not in all_helpers:
                continue  # the script's own
            uses = len(re.findall(rf"\b{helper}\b", source))
            assert uses > 1, f"{name}.lua carries {helper}() without calling it"
        for helper in all_helpers:
            if re.search(rf"\b{helper}\(", source):
                assert helper in defined, f"{name}.lua calls {helper}() but lacks it"


_BOUND = re.compile(r"^local ((?:MAX|MIN)_\w+) = (\d+)\b", re.M)


def test_every_lua_bound_equals_the_schema() -> None:
    """The bounds of stored numbers (a value outside them is corrupt) are the same in
    the scripts and in the Python that writes and reads them."""
    lib = (resources.files("kvstate") / "scripts" / "_lib.lua").read_text()
    lua = {name: int(value) for name, value in _BOUND.findall(lib)}
    py = {k: v for k, v in vars(schema).items() if k.startswith(("MAX_", "MIN_"))}
    assert lua and lua == py, (lua, py)
