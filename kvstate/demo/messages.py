"""What the router and the workers say to each other: frozen dataclasses, pickled over
spawn queues, pipes or ``--listen`` TCP queues. Nothing about a room's *state* travels
here; that goes through Redis only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from kvstate.defaults import LEASE
from kvstate.store import Options

__all__ = [
    "DEMO_OPTIONS",
    "INTERRUPTED",
    "Abort",
    "Bye",
    "Die",
    "Job",
    "Ready",
    "Release",
    "Result",
    "Stop",
    "ToRouter",
    "ToWorker",
    "WorkerConfig",
    "WorkerFailed",
]

INTERRUPTED = "demo interrupted: the room was cleared in flight"
# Every room of the demo is traced (`kvstate trace ROOM`); ?trace_rate= in a --url wins.
DEMO_OPTIONS = Options(trace_rate=1.0)
DEMO_ROOM_TTL = 60.0  # s: the demo's rooms live ~50 ms; a short TTL shows a leak within the run


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs to build its pool, transport and manager."""

    url: str
    namespace: str
    page_bytes: int = 16384
    pool_pages: int = 1024
    layers: int = 2
    device: str = "cpu"
    lease: float = LEASE
    room_ttl: float = DEMO_ROOM_TTL
    timeout: float = 30.0  # bootstrap, waiting and transfer timeouts
    parent_pid: int = 0  # exit when the router is gone (0: do not watch)
    hold: float = 0.0  # seconds a room waits in WaitingForInput before its transfer


# -- router -> worker ---------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One request, as the router hands it to both sides."""

    room: int
    pages: int
    prefill: str
    prefill_addr: str
    abort: str = ""  # which worker aborts it mid-way: "prefill", "decode" or ""


@dataclass(frozen=True)
class Release:
    """The sender of this failed room can no longer write into the decode side's pages:
    they may go back to the free list."""

    room: int


@dataclass(frozen=True)
class Stop:
    """Finish the rooms in hand, then say goodbye."""


@dataclass(frozen=True)
class Abort:
    """Interrupted: clear every room in hand and say goodbye."""


@dataclass(frozen=True)
class Die:
    """Fault injection: SIGKILL yourself (a remote worker the router cannot signal)."""


ToWorker: TypeAlias = Job | Release | Stop | Abort | Die


# -- worker -> router ---------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The worker's engine is registered and takes jobs."""

    engine: str
    role: str
    addr: str
    pid: int
    host: str


@dataclass(frozen=True)
class Result:
    """One side's outcome for one room."""

    room: int
    role: str
    engine: str
    status: str  # "Success" or "Failed"
    reason: str = ""
    verified: bool | None = None  # decode only: every byte matched
    bad_pages: int = 0
    nbytes: int = 0
    busy_s: float = 0.0  # prefill: inside send() (transfer + state); decode: verifying
    write_s: float = 0.0  # prefill: inside the transport's write (the bytes alone)


@dataclass(frozen=True)
class Bye:
    """The worker is done: its transport stats and round trips, for the summary."""

    engine: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerFailed:
    """The worker raised: its traceback, shown by the router."""

    engine: str
    traceback: str


ToRouter: TypeAlias = Ready | Result | Bye | WorkerFailed
