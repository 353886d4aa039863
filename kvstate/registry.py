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

from kvstate import schema
from kvstate.codec import pack, unpack
from kvstate.errors import CorruptStateError, EngineNameTakenError
from kvstate.store import Store

_TEXT_FIELDS = (schema.ROLE, schema.ADDR, schema.INCARNATION, schema.HOST, schema.PID)


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
            schema.ROLE: self.role,
            schema.ADDR: self.addr,
            schema.INCARNATION: self.incarnation,
            schema.ENDPOINT: self.endpoint,
            schema.LAYOUT: pack({"layout": self.layout}),
            schema.HOST: self.host,
            schema.PID: self.pid,
            schema.GPUS: pack({"gpus": self.gpus}),
            schema.RANKS: self.ranks,
        }

    @classmethod
    def decode(cls, key: str, engine: str, raw: dict[bytes, bytes], pttl: int) -> EngineInfo:
        h = {k.decode(): v for k, v in raw.items()}
        try:
            text = {n: h[n].decode() for n in _TEXT_FIELDS}
            pid = int(text[schema.PID])
            ranks = int(h.get(schema.RANKS, b"1"))
        except (KeyError, UnicodeDecodeError, ValueError) as exc:
            raise CorruptStateError(key, str(exc), "engine registration is incomplete") from None
        layout = unpack(h.get(schema.LAYOUT), key, schema.LAYOUT).get("layout")
        gpus = unpack(h.get(schema.GPUS), key, schema.GPUS).get("gpus")
        if not isinstance(layout, dict) or not isinstance(gpus, list):
            raise CorruptStateError(key, schema.LAYOUT, "layout is not a map or gpus not a list")
        return cls(
            engine,
            text[schema.ROLE],
            text[schema.ADDR],
            text[schema.INCARNATION],
            h.get(schema.ENDPOINT, b""),
            layout,
            text[schema.HOST],
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
        s, ms = self.store, int(lease * 1000)
        claim: Claim = s.execute(
            [s.claim_engine(info.engine, info.incarnation, mode, ms, info.fields(), Claim.parse)]
        )[0]
        if claim.answer != "taken":  # a refused or taken claim must not index anything
            s.execute([s.index_engine(info.addr, info.engine, ms)])
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
        claim = s.execute([s.claim_engine(engine, incarnation, "drop", 1, {}, Claim.parse)])[0]
        if claim.answer != "dropped":
            return False
        s.execute([s.index_engine(addr, engine, None)])
        return True

    def incarnations(self, engines: list[str]) -> dict[str, str | None]:
        """Engine -> the incarnation holding its name now, None when none does."""
        s = self.store
        raw = s.execute([s.engine_field(e, schema.INCARNATION) for e in engines])
        return dict(zip(engines, raw, strict=True))

    def get_many(self, engines: list[str]) -> dict[str, EngineInfo | None]:
        s = self.store
        calls = []
        for e in engines:
            key = self.keys.engine(e)
            calls += [s.read_hash(key), s.key_ttl(key)]
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
        raw = s.execute([s.tracked(self.keys.engines_at(addr))])[0]
        names = sorted(n.decode() for n in raw)
        if not names:
            return []
        return [
            e
            for e in self.get_many(names).values()
            if e is not None and e.addr == addr and (role is None or e.role == role)
        ]
