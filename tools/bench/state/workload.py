"""The workload: one room's full lifecycle on both sides, single and batched."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

import kvstate
from kvstate.store import Store

HB = 3600.0  # lease: keeps heartbeats out of the counts
EVAL_ENV = "KVSTATE_BENCH_EVAL"  # --eval, for the worker processes too


def lifecycle(p: kvstate.KVManager, d: kvstate.KVManager, room: int, pages: np.ndarray) -> None:
    """One room, both sides, one call at a time (a poll each, both clears)."""
    rcv = d.receiver(room, p.bootstrap_addr)
    rcv.init(pages)
    snd = p.sender(room)
    assert snd.poll() == kvstate.KVPoll.WaitingForInput
    snd.begin_transfer()
    snd.finish_transfer()
    assert rcv.poll() == kvstate.KVPoll.Success
    snd.clear()
    rcv.clear()


def batch_lifecycles(
    p: kvstate.KVManager, d: kvstate.KVManager, rooms: Sequence[int], pages: np.ndarray
) -> None:
    """The same for many rooms at once, as an engine's scheduler step would."""
    for r in rooms:
        d.receiver(r, p.bootstrap_addr)
        p.sender(r)
    d.init_many(dict.fromkeys(rooms, pages))
    ready = p.poll_many(rooms)
    assert set(ready.values()) == {kvstate.KVPoll.WaitingForInput}, ready
    p.begin_many(rooms)
    p.finish_many(rooms)
    done = d.poll_many(rooms)
    assert set(done.values()) == {kvstate.KVPoll.Success}, done
    p.clear_many(rooms)
    d.clear_many(rooms)


def apart_room(store: Store, addr: str, start: int) -> int:
    """The first room from ``start`` whose keys and whose address tracker shard (issue 33:
    ``addr:<addr>#<room % 64>``) live on two different Cluster nodes (``start`` on a
    standalone server): a single lifecycle then takes the Cluster's most round trips
    (10), so runs that compare theirs (the trace's modes) compare like with like."""
    if not store.cluster:
        return start
    client: Any = store.client
    room = start
    while client.get_node_from_key(store.keys.room_hash(room)) == client.get_node_from_key(
        store.keys.tracker(addr, room)
    ):
        room += 1
    return room


@contextmanager
def pair(
    store: Store, worker: int = 0, lease: float = HB, addr: str | None = None
) -> Iterator[tuple[kvstate.KVManager, kvstate.KVManager]]:
    """A prefill and a decode engine; each worker process its own (own address too:
    ``addr``, else 10.0.<worker>.1:8998)."""
    addr = addr or f"10.0.{worker}.1:8998"
    with (
        kvstate.KVManager(store, "prefill", f"prefill-{worker}.tp0", addr, lease=lease) as p,
        kvstate.KVManager(store, "decode", f"decode-{worker}.tp0", lease=lease) as d,
    ):
        yield p, d


def connect(url: str, namespace: str, eval_only: bool = False, **kw: Any) -> Store:
    """kvstate.connect, on the EVAL path when asked (``eval_only``, or ``--eval``)."""
    if not (eval_only or os.environ.get(EVAL_ENV) == "1"):
        return kvstate.connect(url, namespace=namespace, **kw)
    store = kvstate.connect(url, namespace=namespace, preload_scripts=False, **kw)
    store.eval_only = True
    store.load_scripts()
    return store
