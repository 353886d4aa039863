"""The ctypes declarations in ``transports/ucx/abi.py`` against the installed UCX headers.

At start-up the transport checks only the UCX version; a struct that changed
shape between UCX releases would make ``ucp_mem_map`` or ``ucp_put_nbx`` read
garbage. So this test compiles a small C program against the headers that the
``libucx`` wheel ships and compares, for every ``ctypes.Structure`` in
``abi.STRUCTS``, its size and each field's offset and size, and the value of
each constant in ``abi.C_CONSTANTS``. No compiler or no headers is a failure
saying what to install; only a host without ucxx skips.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _headers() -> Path:
    """The include directory of the UCX that ucxx loads (the libucx wheel's)."""
    try:
        import libucx
    except ImportError:
        pytest.fail("libucx is not importable: pip install 'kvstate[ucx]' (libucx-cu12)")
    include = Path(os.path.dirname(libucx.__file__)) / "include"
    if not (include / "ucp" / "api" / "ucp.h").is_file():
        pytest.fail(
            f"no UCX headers at {include}/ucp/api/ucp.h: reinstall libucx-cu12, "
            "which ships them, to check the ctypes declarations"
        )
    return include


def _compiler() -> str:
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail(
            "no C compiler (cc/gcc, or $CC): install one (apt-get install gcc) to check "
            "the ctypes struct layouts against the UCX headers"
        )
    return cc


def _program(structs: list[type[ctypes.Structure]], constants: list[str]) -> str:
    """C source printing 'key value' lines: sizes, field offsets and sizes, constants."""
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        "#include <ucp/api/ucp.h>",
        "int main(void) {",
    ]
    for struct in structs:
        c = struct.c_name  # declared on each of abi.py's structs
        lines.append(f'printf("{c} sizeof %zu\\n", sizeof({c}));')
        for name, *_ in struct._fields_:
            lines.append(f'printf("{c}.{name} offset %zu\\n", offsetof({c}, {name}));')
            lines.append(f'printf("{c}.{name} size %zu\\n", sizeof((({c} *)0)->{name}));')
    for name in constants:
        lines.append(f'printf("{name} value %lld\\n", (long long)({name}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines) + "\n"


def _python_side(structs: list[type[ctypes.Structure]], constants: dict[str, int]) -> list[str]:
    out = []
    for struct in structs:
        c = struct.c_name  # declared on each of abi.py's structs
        out.append(f"{c} sizeof {ctypes.sizeof(struct)}")
        for name, ctype, *_ in struct._fields_:
            out.append(f"{c}.{name} offset {getattr(struct, name).offset}")
            out.append(f"{c}.{name} size {ctypes.sizeof(ctype)}")
    out += [f"{name} value {value}" for name, value in constants.items()]
    return out


def test_ctypes_layouts_match_the_ucx_headers(tmp_path: Path) -> None:
    pytest.importorskip("ucxx", reason="ucxx not installed (the [ucx] extra)")
    from transports.ucx import abi

    structs = list(abi.STRUCTS)
    declared = {
        obj
        for obj in vars(abi).values()
        if isinstance(obj, type)
        and issubclass(obj, ctypes.Structure)
        and obj.__module__ == abi.__name__
    }
    assert declared == set(structs), "every Structure in abi.py must be listed in abi.STRUCTS"

    include, cc = _headers(), _compiler()
    source = tmp_path / "layout.c"
    source.write_text(_program(structs, list(abi.C_CONSTANTS)))
    binary = tmp_path / "layout"
    build = subprocess.run(
        [cc, "-std=gnu11", f"-I{include}", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, (
        f"compiling against {include} failed (a field renamed in this UCX?):\n{build.stderr}"
    )
    c_side = subprocess.run([str(binary)], capture_output=True, text=True, check=True)
    assert c_side.stdout.splitlines() == _python_side(structs, abi.C_CONSTANTS)


def test_import_without_ucxx_says_what_to_install() -> None:
    """The core installs without ucxx: the contract and CMA import, UCX says how to add it."""
    code = (
        "import sys\n"
        "sys.modules['ucxx'] = None  # as if not installed\n"
        "import transports, transports.base, transports.cma, transports.pages\n"
        "try:\n"
        "    import transports.ucx\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert "pip install 'kvstate[ucx]'" in result.stdout, result.stdout + result.stderr
