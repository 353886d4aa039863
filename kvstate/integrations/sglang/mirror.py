"""Mirror mode: SGLang's own transfer backend moves the bytes, kvstate keeps the state."""

from __future__ import annotations

import contextlib
from typing import Any

from kvstate.integrations.sglang.manager import (
    KVStateKVManager,
)
from kvstate.integrations.sglang.participants import (
    KVStateKVReceiver,
    KVStateKVSender,
)
from kvstate.poll import KVPoll

# -- mirror mode ----------------------------------------------------------------------


_MIRRORS: dict[type, type] = {}


def mirrored(base: type, kind: str, backend: str) -> type:
    """``base`` (another backend's manager, sender or receiver class) with kvstate
    keeping the per-room state beside it: the bytes still go the base's way."""
    key = base
    if key not in _MIRRORS:
        body = {"manager": _mirror_manager, "sender": _mirror_sender, "receiver": _mirror_receiver}[
            kind
        ](base, backend)
        _MIRRORS[key] = type(f"KVStateMirror{base.__name__}", (base,), body)
    return _MIRRORS[key]


def _mirror_manager(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        **kw: Any,
    ) -> None:
        base.__init__(self, args, disaggregation_mode, server_args, is_mla_backend, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVManager(
            args, disaggregation_mode, server_args, is_mla_backend, mirror=True
        )

    return {"__init__": __init__}


def _mirror_sender(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any, mgr: Any, bootstrap_addr: str, bootstrap_room: int, *a: Any, **kw: Any
    ) -> None:
        base.__init__(self, mgr, bootstrap_addr, bootstrap_room, *a, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVSender(mgr.kvstate, bootstrap_addr, bootstrap_room)

    def poll(self: Any) -> KVPoll:
        return self.kvstate.mirror(base.poll(self), backend)  # type: ignore[attr-defined, no-any-return]

    def send(self: Any, *a: Any, **kw: Any) -> Any:
        self.kvstate.mirror_begin()
        return base.send(self, *a, **kw)  # type: ignore[attr-defined]

    return {"__init__": __init__, "poll": poll, "send": send, **_mirror_common(base)}


def _mirror_receiver(base: type, backend: str) -> dict[str, Any]:
    def __init__(
        self: Any,
        mgr: Any,
        bootstrap_addr: str,
        bootstrap_room: int | None = None,
        *a: Any,
        **kw: Any,
    ) -> None:
        base.__init__(self, mgr, bootstrap_addr, bootstrap_room, *a, **kw)  # type: ignore[misc]
        self.kvstate = KVStateKVReceiver(mgr.kvstate, bootstrap_addr, bootstrap_room)

    def init(self: Any, prefill_dp_rank: int, *a: Any, **kw: Any) -> Any:
        self.kvstate.init(prefill_dp_rank)
        return base.init(self, prefill_dp_rank, *a, **kw)  # type: ignore[attr-defined]

    def send_metadata(
        self: Any,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        *a: Any,
        **kw: Any,
    ) -> Any:
        # published in kvstate before the other backend can see the metadata, so the
        # prefill's kvstate sender is ready when its transfer starts
        self.kvstate.send_metadata(
            kv_indices, aux_index, state_indices, kw.get("decode_prefix_len")
        )
        return base.send_metadata(self, kv_indices, aux_index, state_indices, *a, **kw)  # type: ignore[attr-defined]

    def poll(self: Any) -> KVPoll:
        return self.kvstate.mirror(base.poll(self), backend)  # type: ignore[attr-defined, no-any-return]

    return {
        "__init__": __init__,
        "init": init,
        "send_metadata": send_metadata,
        "poll": poll,
        **_mirror_common(base),
    }


def _mirror_common(base: type) -> dict[str, Any]:
    def failure_exception(self: Any) -> None:
        """kvstate's reason when kvstate failed the room (an abort the other backend
        never heard of), else the other backend's own exception."""
        st = self.kvstate
        if st.failed_in_kvstate:
            with contextlib.suppress(Exception):
                base.failure_exception(self)  # type: ignore[attr-defined]  # its own cleanup
            st.failure_exception()  # raises SGLang's KVTransferError with the reason
        st.clear()
        base.failure_exception(self)  # type: ignore[attr-defined]

    def abort(self: Any) -> None:
        self.kvstate.abort()
        base.abort(self)  # type: ignore[attr-defined]

    def clear(self: Any) -> None:
        self.kvstate.clear()
        base.clear(self)  # type: ignore[attr-defined]

    return {"failure_exception": failure_exception, "abort": abort, "clear": clear}
