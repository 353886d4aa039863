"""The ``sglang.srt.plugins`` entry point: small, so SGLang's plugin loader can run
it in every process, and the version check comes before any SGLang interface is
touched (they changed in each of the four releases before 0.5.23)."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

from kvstate.errors import UnsupportedSGLangError
from kvstate.integrations.sglang_release import BACKEND, SUPPORTED_SGLANG, check_version

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
_hooked = False


def plugin() -> None:
    """Add the ``kvstate`` backend choice, the ``TransferBackend`` member and the
    AROUND hook on ``get_kv_class`` (SGLang rebinds its imported copies)."""
    check_version()
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    add_enum_member(TransferBackend, "KVSTATE", BACKEND)
    global _hooked
    if not _hooked:  # load_plugins() may run more than once in a process
        HookRegistry.register(GET_KV_CLASS, get_kv_class, HookType.AROUND)
        _hooked = True


def add_enum_member(cls: type[enum.Enum], name: str, value: str) -> None:
    """Give a plain Enum one more member; idempotent."""
    if value in cls._value2member_map_:
        return
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    setattr(cls, name, member)
    cls._member_map_[name] = member
    cls._member_names_.append(name)
    cls._value2member_map_[value] = member


def mirrored_backends() -> set[str]:
    """``KVSTATE_SGLANG_MIRROR``: backends (comma-separated; ``1`` = mooncake,nixl) whose
    classes keep their bytes path while kvstate keeps the per-room state."""
    raw = os.environ.get("KVSTATE_SGLANG_MIRROR", "").strip()
    if raw.lower() in ("", "0", "false", "no"):
        return set()
    if raw.lower() in ("1", "true", "yes"):
        return {"mooncake", "nixl"}
    return {b.strip() for b in raw.split(",") if b.strip()}


def get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """The AROUND hook: kvstate's classes for the kvstate backend; mirrored classes for
    the backends named in ``KVSTATE_SGLANG_MIRROR``; else SGLang's own."""
    value = getattr(transfer_backend, "value", transfer_backend)
    name = getattr(class_type, "value", class_type)
    if value != BACKEND:
        cls = original(transfer_backend, class_type)
        if name in ("manager", "sender", "receiver") and value in mirrored_backends():
            from kvstate.integrations.sglang import mirrored

            return mirrored(cls, name, value)
        return cls
    if name == "kvargs":  # every backend shares SGLang's KVArgs
        return original(transfer_backend, class_type)
    from kvstate.integrations import sglang

    return {
        "manager": sglang.KVStateKVManager,
        "sender": sglang.KVStateKVSender,
        "receiver": sglang.KVStateKVReceiver,
        "bootstrap_server": sglang.KVStateBootstrapServer,
    }[name]


__all__ = ["BACKEND", "SUPPORTED_SGLANG", "UnsupportedSGLangError", "check_version", "plugin"]
