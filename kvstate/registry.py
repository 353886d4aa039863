"""Engine registry and leases: ``kvstate:<ns>:engine:<engine>`` hashes whose TTL is
the engine's lease, renewed by a heartbeat. A peer whose key is gone, or whose
incarnation changed, is dead to the rooms bound to it. One owner per name:
registering, renewing and dropping are one script (register.lua) that never
displaces a live holder. ``engines_at:<addr>`` indexes engines by bootstrap address.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from kvstate.codec import pack, unpack
from kvstate.errors import CorruptStateError, EngineNameTakenError
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
    ranks: int = 1  # prefill engines serving ``addr`` (TP ranks): how many a receiver needs

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
            "ranks": self.ranks,
        }

    @classmethod
    def decode(cls, key: str, engine: str, raw: dict[bytes, bytes], pttl: int) -> EngineInfo:
        h = {k.decode(): v for k, v in raw.items()}
        try:
            text = {n: h[n].decode() for n in ("role", "addr", "incarnation", "host", "pid")}
            pid = int(text["pid"])
            ranks = int(h.get("ranks", b"1"))
        except (KeyError, UnicodeDecodeError, ValueError) as exc:
            raise CorruptStateError(key, str(exc), "engine registration is incomplete") from None
        layout = unpack(h.get("layout"), key, "layout").get("layout")
        gpus = unpack(h.get("gpus"), key, "gpus").get("gpus")
        if not isinstance(layout, dict) or not isinstance(gpus, list):
            raise CorruptStateError(key, "layout", "layout is not a map or gpus not a list")
        return cls(
            engine,
            text["role"],
            text["addr"],
            text["incarnation"],
            h.get("endpoint", b""),
            layout,
            text["host"],
            pid,
            gpus,
            pttl,
            ranks,
        )


@dataclass(frozen=True)
class Claim:
    """register.lua's answer, and who holds the name now."""

    answer: str  # registered / renewed / lapsed / taken / dropped / gone
    holder: str
    host: str
    pid: str

    @classmethod
    def parse(cls, raw: Any) -> Claim:
        return cls(*(v.decode() if isinstance(v, bytes) else str(v) for v in raw))


class Registry:
    """Reads and writes engine registrations of one namespace."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    def claim(self, info: EngineInfo, lease: float, mode: str) -> Claim:
        """Register (``mode`` 'register') or renew ('renew') ``info`` if the name is free
        or already ours, then refresh its address index entry (another slot on a Cluster,
        hence a second call)."""
        flat: list[Any] = []
        for name, value in info.fields().items():
            flat += [name, value]
        s, ms = self.store, int(lease * 1000)
        claim: Claim = s.execute(
            [
                s.script(
                    "register",
                    [self.keys.engine(info.engine)],
                    [ms, info.incarnation, mode, *flat],
                    Claim.parse,
                )
            ]
        )[0]
        if claim.answer != "taken":  # a refused or taken claim must not index anything
            s.execute([s.script("index", [self.keys.engines_at(info.addr)], [info.engine, ms])])
        return claim

    def register(self, info: EngineInfo, lease: float) -> None:
        """Claim the name for a new manager; EngineNameTakenError if a live process
        holds it."""
        claim = self.claim(info, lease, "register")
        if claim.answer == "taken":
            raise EngineNameTakenError(
                info.engine, claim.holder, claim.host, claim.pid, self.store.namespace
            )

    def renew(self, info: EngineInfo, lease: float) -> Claim:
        """Extend the lease (or register again if it lapsed and the name is free)."""
        return self.claim(info, lease, "renew")

    def drop(self, engine: str, incarnation: str, addr: str) -> bool:
        """Delete the registration if it is still this incarnation's; True if it was."""
        s = self.store
        claim = s.execute(
            [
                s.script(
                    "register", [self.keys.engine(engine)], [1, incarnation, "drop"], Claim.parse
                )
            ]
        )[0]
        if claim.answer != "dropped":
            return False
        s.execute([s.script("index", [self.keys.engines_at(addr)], [engine, ""])])
        return True

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
        names = sorted(k[len(prefix) :] for k in self.store.scan(self.keys.engine_pattern))
        return [info for info in self.get_many(names).values() if info is not None]

    def at_addr(self, addr: str, role: str | None = None) -> list[EngineInfo]:
        """Live engines registered at a bootstrap address, by name: the index names
        candidates, each one's own registration decides (no SCAN)."""
        s = self.store
        raw = s.execute([s.command("ZRANGE", self.keys.engines_at(addr), args=[0, -1])])[0]
        names = sorted(n.decode() for n in raw)
        if not names:
            return []
        return [
            e
            for e in self.get_many(names).values()
            if e is not None and e.addr == addr and (role is None or e.role == role)
        ]
