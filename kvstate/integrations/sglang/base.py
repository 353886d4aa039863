"""SGLang's abstract transfer-backend classes, which kvstate's manager, sender, receiver
and bootstrap server derive from so that SGLang's isinstance checks hold. Importing
them is what the ``[sglang]`` extra installs; they are named here once, for every
module of the backend."""

from __future__ import annotations

from typing import Any


def _sglang_base() -> Any:
    from sglang.srt.disaggregation.base import conn

    return conn


conn: Any = _sglang_base()
BaseManager: Any = conn.BaseKVManager
BaseSender: Any = conn.BaseKVSender
BaseReceiver: Any = conn.BaseKVReceiver
BaseServer: Any = conn.BaseKVBootstrapServer

__all__ = ["BaseManager", "BaseReceiver", "BaseSender", "BaseServer", "conn"]
