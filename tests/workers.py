"""Entry points for processes the tests spawn (module-level so `spawn` can import them)."""

from __future__ import annotations

import random
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import kvstate
from kvstate import KVPoll


def race_updates(url: str, ns: str, engine: str, rooms: list[int], seed: int,
                 start: Event, results: Queue) -> None:
    """Apply a random sequence of status updates to shared rooms, then ack receivers.

    Puts the (room, status) updates applied on ``results``, so the parent can predict
    the merge."""
    store = kvstate.connect(url, namespace=ns)
    rng = random.Random(seed)
    applied: list[tuple[int, str]] = []
    choices = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed]
    calls = []
    for _ in range(len(rooms) * 6):
        room = rng.choice(rooms)
        status = rng.choices(choices, weights=[3, 3, 3, 1])[0]
        applied.append((room, status.name))
        calls.append(store.update(room, "tx", "shared", status, f"failed by {engine}"))
    start.wait(30)
    for i in range(0, len(calls), 7):  # small batches so processes interleave
        store.execute(calls[i : i + 7])
    for room in rooms:  # every racer acks every receiver once
        store.execute([store.finish(room, engine, ["rx-4", "rx-5"])])
    store.close()
    results.put(applied)


def prefill_engine(url: str, ns: str, engine: str, addr: str, lease: float,
                   ready: Event) -> None:
    """A prefill engine that registers, signals, and keeps its lease until killed."""
    store = kvstate.connect(url, namespace=ns)
    kvstate.KVManager(store, "prefill", engine, addr, lease=lease)
    ready.set()
    while True:
        time.sleep(1)
