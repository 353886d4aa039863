"""libucp through ctypes: only what ucxx does not expose (RMA and flush).

This is the one file tied to UCX's binary interface. At start-up
:class:`LibUCP` checks only the UCX version (1.16-1.x; tested with 1.21 from
``libucx-cu12``). The struct layouts (size, offset and size of every field of
each ``ctypes.Structure`` here) and the values in :data:`C_CONSTANTS` are
checked against the installed UCX headers by ``tests/test_ucx_abi.py``, which
compiles a small C program: run it after changing the UCX version.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

from transports.base import TransportError

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + UCS_ERR_LAST  # UCS_PTR_IS_ERR: ptr >= (uintptr_t)UCS_ERR_LAST

MEM_MAP_FIELD_ADDRESS = 1 << 0
MEM_MAP_FIELD_LENGTH = 1 << 1
OP_ATTR_FIELD_MEMH = 1 << 8

#: C name -> the value used here (compared with the headers by tests/test_ucx_abi.py)
C_CONSTANTS: dict[str, int] = {
    "UCS_OK": UCS_OK,
    "UCS_INPROGRESS": UCS_INPROGRESS,
    "UCS_ERR_LAST": UCS_ERR_LAST,
    "UCP_MEM_MAP_PARAM_FIELD_ADDRESS": MEM_MAP_FIELD_ADDRESS,
    "UCP_MEM_MAP_PARAM_FIELD_LENGTH": MEM_MAP_FIELD_LENGTH,
    "UCP_OP_ATTR_FIELD_MEMH": OP_ATTR_FIELD_MEMH,
}


class MemMapParams(ctypes.Structure):
    c_name: ClassVar[str] = "ucp_mem_map_params_t"
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class RequestParam(ctypes.Structure):
    c_name: ClassVar[str] = "ucp_request_param_t"
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),  # a union of callback pointers
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),  # a union of pointers
        ("memh", ctypes.c_void_p),
    ]


#: every struct declared here, for tests/test_ucx_abi.py
STRUCTS: tuple[type[ctypes.Structure], ...] = (MemMapParams, RequestParam)


class LibUCP:
    """The libucp already loaded by ucxx (found in /proc/self/maps, not a second copy)."""

    def __init__(self) -> None:
        path = self._loaded_path()
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        major, minor, release = u(), u(), u()
        lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.version = (major.value, minor.value, release.value)
        if major.value != 1 or minor.value < 16:
            raise TransportError(
                f"UCX {major.value}.{minor.value} found at {path}: the ctypes declarations "
                "in transports/ucx/abi.py are written for UCX 1.16-1.x (tested with 1.21); "
                "install libucx-cu12 1.21 or check them with tests/test_ucx_abi.py"
            )

        def fn(name: str, res: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = list(args)
            return f

        self.mem_map = fn(
            "ucp_mem_map", ctypes.c_int, vp, ctypes.POINTER(MemMapParams), ctypes.POINTER(vp)
        )
        self.mem_unmap = fn("ucp_mem_unmap", ctypes.c_int, vp, vp)
        self.rkey_pack = fn(
            "ucp_rkey_pack", ctypes.c_int, vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)
        )
        self.rkey_buffer_release = fn("ucp_rkey_buffer_release", None, vp)
        self.ep_rkey_unpack = fn(
            "ucp_ep_rkey_unpack", ctypes.c_int, vp, ctypes.c_char_p, ctypes.POINTER(vp)
        )
        self.rkey_destroy = fn("ucp_rkey_destroy", None, vp)
        self.put_nbx = fn(
            "ucp_put_nbx", vp, vp, vp, sz, ctypes.c_uint64, vp, ctypes.POINTER(RequestParam)
        )
        self.ep_flush_nbx = fn("ucp_ep_flush_nbx", vp, vp, ctypes.POINTER(RequestParam))
        self.request_check_status = fn("ucp_request_check_status", ctypes.c_int, vp)
        self.request_free = fn("ucp_request_free", None, vp)
        self._status_string = fn("ucs_status_string", ctypes.c_char_p, ctypes.c_int)

    @staticmethod
    def _loaded_path() -> str:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libucp.so"):
                    return path
        raise TransportError("libucp is not loaded in this process (ucxx import failed?)")

    def status_string(self, status: int) -> str:
        text = self._status_string(status)
        return text.decode() if text else f"UCX status {status}"

    def check(self, status: int, what: str) -> None:
        if status != UCS_OK:
            raise TransportError(f"{what} failed: {self.status_string(status)}")


def ptr_status(ptr: int | None) -> int:
    """UCS_PTR_STATUS for a ``ucs_status_ptr_t``: 0 done, 1 pending request, <0 error."""
    if not ptr:
        return UCS_OK
    if ptr >= _PTR_ERR_MIN:
        return ptr - (1 << 64)
    return UCS_INPROGRESS
