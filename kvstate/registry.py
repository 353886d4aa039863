"""Engine registry and leases: ``kvstate:<ns>:engine:<engine>`` hashes whose TTL is
the engine's lease, renewed by a heartbeat. A peer whose key is gone, or whose
incarnation changed, is dead to the rooms bound to it. One owner per name:
registering, renewing and dropping are one script (register.lua) that never
displaces a live holder. ``engines_at:<addr>`` indexes engines by bootstrap address,
each member carrying the incarnation and group size a receiver binds by
(``index_member``), so one read of it serves a binding (issue 22).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from kvstate import schema
from kvstate.codec import pack, unpack
from kvstate.errors import CorruptStateError, EngineNameTakenError
from kvstate.store import (
    LIBRARY_NAME,
    Call,
    Store,
    command_call,
    pairs,
    script_call,
    text_or_none,
)

log = logging.getLogger(__name__)
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
    library: str = LIBRARY_NAME  # its kvstate's FUNCTION library ('' if it did not say)

    def index_member(self) -> str:
        """This registration's member of its address's index (index.lua): what a
        receiver binds by, so that it needs no read of the registration itself."""
        return index_member(self.engine, self.incarnation, self.ranks, self.role)

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
            schema.LIBRARY: self.library,
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
            h.get(schema.LIBRARY, b"").decode("utf-8", "replace"),
        )


def index_member(engine: str, incarnation: str, ranks: int, role: str) -> str:
    """``<engine> <incarnation> <ranks> <role>``: names carry no spaces (keys.check_name),
    incarnations are hex; publish.lua's lookup parses the same four words."""
    return f"{engine} {incarnation} {ranks} {role}"


def parse_member(member: str) -> tuple[str, str, int, str] | None:
    """(engine, incarnation, ranks, role) of an index member; None for one that is not
    of that shape (a plain engine name written by an older kvstate)."""
    words = member.split(" ")
    if len(words) != 4 or not (words[2].isascii() and words[2].isdigit()):
        return None
    if len(words[2]) > 6 or int(words[2]) > schema.MAX_PEERS:  # publish.lua skips it too
        return None
    return words[0], words[1], int(words[2]), words[3]


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
    """Reads and writes engine registrations of one namespace: it builds its own calls
    (``register.lua``, ``index.lua``, the reads of a registration) and the store runs
    them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    # -- calls ---------------------------------------------------------------------
    def claim_call(
        self, engine: str, incarnation: str, mode: str, lease_ms: int, fields: dict[str, Any]
    ) -> Call:
        """register.lua: register, renew (``fields`` written when the name is free) or
        drop an engine's registration; never displaces a live holder."""
        args = [lease_ms, incarnation, mode, *pairs(fields)]
        return script_call("register", [self.keys.engine(engine)], args, Claim.parse)

    def index_call(self, addr: str, member: str, lease_ms: int | None) -> Call:
        """index.lua: list ``member`` (``index_member``) under its bootstrap address
        until ``lease_ms`` from now; with ``lease_ms`` None take ``member`` ("<engine>
        <incarnation>") off the index; with ``member`` '' read the live members and their
        deadlines."""
        args = [member, "" if lease_ms is None else lease_ms]
        return script_call("index", [self.keys.engines_at(addr)], args)

    def field_call(self, engine: str, name: str) -> Call:
        """One field of an engine's registration, as text (None when it has none)."""
        return command_call("HGET", self.keys.engine(engine), args=[name], parse=text_or_none)

    def claim(self, info: EngineInfo, lease: float, mode: str) -> Claim:
        """Register (``mode`` 'register') or renew ('renew') ``info`` if the name is free
        or already ours, then refresh its address index entry (another slot on a Cluster,
        hence a second call)."""
        s, ms = self.store, int(lease * 1000)
        started = time.monotonic()
        claim: Claim = s.execute(
            [self.claim_call(info.engine, info.incarnation, mode, ms, info.fields())]
        )[0]
        if claim.answer != "taken":  # a refused or taken claim must not index anything
            # the lease left, not a whole one: receivers bind by the index alone, so its
            # deadline must not outlive the registration's TTL set by the claim
            left = ms - int((time.monotonic() - started) * 1000)
            s.execute([self.index_call(info.addr, info.index_member(), max(left, 1))])
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
        """Extend the lease (or register again if it lapsed and the name is free). A
        registration gone at its renewal is logged at WARNING: a heartbeat renews well
        within the lease, so unless this process stalled, something deleted it, most
        often an eviction (a maxmemory-policy other than noeviction: issue 30 saw 49 in
        one run under allkeys-lru), and its peers may have failed its rooms meanwhile."""
        claim = self.claim(info, lease, "renew")
        if claim.answer == "lapsed":
            log.warning(
                "registration of engine %s (namespace %s) was gone when its lease was "
                "renewed: evicted (maxmemory-policy is not noeviction? `kvstate audit` "
                "says), deleted, or this process stalled past its lease; registered again",
                info.engine,
                self.store.namespace,
            )
        return claim

    def drop(self, engine: str, incarnation: str, addr: str) -> bool:
        """Delete the registration if it is still this incarnation's; True if it was.
        Its index member goes first: receivers bind by the index alone, and the
        member names this incarnation only, so a new holder's stays."""
        s = self.store
        s.execute([self.index_call(addr, f"{engine} {incarnation}", None)])
        claim = s.execute([self.claim_call(engine, incarnation, "drop", 1, {})])[0]
        return bool(claim.answer == "dropped")

    def incarnations(self, engines: list[str], partial: bool = False) -> dict[str, str | None]:
        """Engine -> the incarnation holding its name now, None when none does; with
        ``partial``, a registration that is no hash is left out (unknown) instead of
        raising CorruptStateError."""
        s = self.store
        raw = s.execute([self.field_call(e, schema.INCARNATION) for e in engines], partial=partial)
        return {
            e: inc for e, inc in zip(engines, raw, strict=True) if not isinstance(inc, Exception)
        }

    def all_read(self) -> tuple[list[EngineInfo], dict[str, str]]:
        """Every registration, by name, and those that do not read (engine -> why: a
        key of the wrong type, an incomplete or corrupt registration): the operator
        views show those as rows and go on, where ``all()`` raises."""
        prefix = self.keys.engine("")
        names = sorted(k[len(prefix) :] for k in self.store.scan(self.keys.engine_pattern))
        infos: list[EngineInfo] = []
        bad: dict[str, str] = {}
        for start in range(0, len(names), 500):
            chunk = names[start : start + 500]
            calls = []
            for e in chunk:
                key = self.keys.engine(e)
                calls += [command_call("HGETALL", key), command_call("PTTL", key)]
            raw = self.store.execute(calls, partial=True)
            for i, e in enumerate(chunk):
                h, pttl = raw[2 * i], raw[2 * i + 1]
                if isinstance(h, Exception):
                    bad[e] = str(h)
                elif h:
                    try:
                        infos.append(EngineInfo.decode(self.keys.engine(e), e, h, int(pttl)))
                    except CorruptStateError as exc:
                        bad[e] = str(exc)
        return infos, bad

    def get_many(self, engines: list[str]) -> dict[str, EngineInfo | None]:
        s = self.store
        calls = []
        for e in engines:
            key = self.keys.engine(e)
            calls += [command_call("HGETALL", key), command_call("PTTL", key)]
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

    def listed_at(self, addr: str, role: str) -> list[EngineInfo]:
        """The engines of ``role`` the index lists as live at ``addr`` (lease deadline
        after now on the server clock), the latest incarnation of each name, by name: in
        one read (index.lua), the way publish.lua's lookup reads it, without the
        registrations (only engine, role, addr, incarnation and ranks are filled in)."""
        s = self.store
        raw = s.execute([self.index_call(addr, "", 0)])[0]
        best: dict[str, tuple[float, str, int]] = {}
        for i in range(0, len(raw), 2):
            parsed = parse_member(raw[i].decode())
            if parsed is None or parsed[3] != role:
                continue
            engine, inc, ranks, _ = parsed
            score = float(raw[i + 1])
            if engine not in best or score > best[engine][0]:
                best[engine] = (score, inc, ranks)
        return [
            EngineInfo(e, role, addr, inc, host="", pid=0, ranks=ranks, library="")
            for e, (_, inc, ranks) in sorted(best.items())
        ]

    def at_addr(self, addr: str, role: str | None = None) -> list[EngineInfo]:
        """Live engines registered at a bootstrap address, by name: the index names
        candidates, each one's own registration decides (no SCAN)."""
        s = self.store
        raw = s.execute([command_call("ZRANGE", self.keys.engines_at(addr), args=[0, -1])])[0]
        names = sorted({n.decode().split(" ")[0] for n in raw})
        if not names:
            return []
        return [
            e
            for e in self.get_many(names).values()
            if e is not None and e.addr == addr and (role is None or e.role == role)
        ]
