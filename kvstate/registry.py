"""Engine registry and leases: ``kvstate:<ns>:engine:<engine>`` hashes whose TTL is
the engine's lease, renewed by a heartbeat. A peer whose key is gone, or whose
incarnation changed, is dead to the rooms bound to it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kvstate.codec import pack, unpack
from kvstate.errors import CorruptStateError
from kvstate.store import Store


@dataclass(frozen=True)
class EngineInfo:
    engine: str
    role: str
    addr: str
    incarnation: str
    endpoint: bytes = b""
    layout: dict[str, Any] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    lease_left_ms: int = -1

    def fields(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "addr": self.addr,
            "incarnation": self.incarnation,
            "endpoint": self.endpoint,
            "layout": pack({"layout": self.layout}),
            "host": self.host,
            "pid": self.pid,
            "gpus": pack({"gpus": self.gpus}),
        }

    @classmethod
    def decode(cls, key: str, engine: str, raw: dict[bytes, bytes], pttl: int) -> EngineInfo:
        h = {k.decode(): v for k, v in raw.items()}
        try:
            text = {n: h[n].decode() for n in ("role", "addr", "incarnation", "host", "pid")}
            pid = int(text["pid"])
        except (KeyError, UnicodeDecodeError, ValueError) as exc:
            raise CorruptStateError(key, str(exc), "engine registration is incomplete") from None
        layout = unpack(h.get("layout"), key, "layout").get("layout")
        gpus = unpack(h.get("gpus"), key, "gpus").get("gpus")
        if not isinstance(layout, dict) or not isinstance(gpus, list):
            raise CorruptStateError(key, "layout", "layout is not a map or gpus not a list")
        return cls(engine, text["role"], text["addr"], text["incarnation"], h.get("endpoint", b""),
                   layout, text["host"], pid, gpus, pttl)


class Registry:
    """Reads and writes engine registrations of one namespace."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    def register(self, info: EngineInfo, lease: float) -> None:
        """Replace the registration whole (stale fields of an older incarnation go)."""
        key = self.keys.engine(info.engine)
        flat: list[Any] = []
        for name, value in info.fields().items():
            flat += [name, value]
        s = self.store
        s.execute(
            [s.command("DEL", key), s.command("HSET", key, args=flat),
             s.command("PEXPIRE", key, args=[int(lease * 1000)])],
            transaction=True,
        )

    def renew(self, engine: str, incarnation: str, lease: float) -> bool:
        """Extend the lease; False if it lapsed or another incarnation holds the id."""
        key = self.keys.engine(engine)
        s = self.store
        current, _ = s.execute(
            [s.command("HGET", key, args=["incarnation"]),
             s.command("PEXPIRE", key, args=[int(lease * 1000)])]
        )
        return current is not None and current.decode() == incarnation

    def drop(self, engine: str, incarnation: str) -> None:
        """Delete the registration if it is still this incarnation's."""
        key = self.keys.engine(engine)
        s = self.store
        current = s.execute([s.command("HGET", key, args=["incarnation"])])[0]
        if current is not None and current.decode() == incarnation:
            s.execute([s.command("DEL", key)])

    def incarnations(self, engines: list[str]) -> dict[str, str | None]:
        s = self.store
        raw = s.execute(
            [s.command("HGET", self.keys.engine(e), args=["incarnation"]) for e in engines]
        )
        return {e: None if r is None else r.decode() for e, r in zip(engines, raw, strict=True)}

    def get_many(self, engines: list[str]) -> dict[str, EngineInfo | None]:
        s = self.store
        calls = []
        for e in engines:
            key = self.keys.engine(e)
            calls += [s.command("HGETALL", key), s.command("PTTL", key)]
        raw = s.execute(calls)
        out: dict[str, EngineInfo | None] = {}
        for i, e in enumerate(engines):
            h, pttl = raw[2 * i], raw[2 * i + 1]
            out[e] = EngineInfo.decode(self.keys.engine(e), e, h, int(pttl)) if h else None
        return out

    def get(self, engine: str) -> EngineInfo | None:
        return self.get_many([engine])[engine]

    def all(self) -> list[EngineInfo]:
        prefix = self.keys.engine("")
        names = sorted(k[len(prefix):] for k in self.store.scan(self.keys.engine_pattern))
        return [info for info in self.get_many(names).values() if info is not None]

    def at_addr(self, addr: str, role: str | None = None) -> list[EngineInfo]:
        """Live engines registered at a bootstrap address (SCAN; callers cache it)."""
        return [e for e in self.all() if e.addr == addr and (role is None or e.role == role)]
