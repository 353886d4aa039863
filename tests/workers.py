"""Entry points for processes the tests spawn (module-level so `spawn` can import them)."""

from __future__ import annotations

import random
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import kvstate
from kvstate import KVPoll
from tests.helpers import scaled

ACKS = 1000  # race_updates acks receivers in room + ACKS, away from the shared sender


def race_updates(
    url: str, ns: str, engine: str, rooms: list[int], seed: int, start: Event, results: Queue
) -> None:
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
    start.wait(scaled(30))
    for i in range(0, len(calls), 7):  # small batches so processes interleave
        store.execute(calls[i : i + 7])
    for room in rooms:  # every racer acks every receiver once (in the acks' room)
        acked = room + ACKS
        store.execute([store.update(acked, "tx", engine, KVPoll.Transferring)])
        store.execute([store.finish(acked, engine, ["rx-4", "rx-5"])])
    store.close()
    results.put(applied)


def prefill_engine(url: str, ns: str, engine: str, addr: str, lease: float, ready: Event) -> None:
    """A prefill engine that registers, signals, and keeps its lease until killed."""
    store = kvstate.connect(url, namespace=ns)
    kvstate.KVManager(store, "prefill", engine, addr, lease=lease)
    ready.set()
    while True:
        time.sleep(1)


def _pool(layers: int, pages: int, page_bytes: int, fill: int | None) -> list:
    import numpy as np

    pool = [np.zeros((pages, page_bytes), dtype=np.uint8) for _ in range(layers)]
    if fill is not None:  # a pattern every (layer, page) can be checked against
        for layer, arr in enumerate(pool):
            arr[:] = (np.arange(pages)[:, None] * 7 + layer * 31 + fill) % 251
    return pool


def expected_page(layer: int, src_page: int, page_bytes: int, fill: int):  # noqa: ANN201
    import numpy as np

    return np.full(page_bytes, (src_page * 7 + layer * 31 + fill) % 251, dtype=np.uint8)


def ucx_prefill(
    url: str,
    ns: str,
    engine: str,
    addr: str,
    rooms: dict[int, list[int]],
    receivers: int,
    layers: int,
    page_bytes: int,
    results: Queue,
    go: Event | None = None,
    stats: bool = False,
) -> None:
    """A prefill rank: sends each room's source pages once every receiver published
    (and, if given, once ``go`` is set)."""
    from transports.ucx import UCXTransport

    store = kvstate.connect(url, namespace=ns)
    transport = UCXTransport()
    transport.register_buffers(_pool(layers, 256, page_bytes, fill=3), [page_bytes] * layers)
    # a transfer deadline well inside the tests' queue timeouts: a write to a dead peer
    # that is not refused at once still fails in time, with a reason
    with kvstate.KVManager(
        store,
        "prefill",
        engine,
        addr,
        transport=transport,
        transfer_timeout=10.0,
        transfer_stats=stats,
    ) as mgr:
        results.put(("ready", engine))
        out = {}
        for room, src in rooms.items():
            snd = mgr.sender(room, required_receivers=receivers)
            deadline = time.monotonic() + scaled(60)
            while snd.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
                time.sleep(0.01)
            if go is not None:
                go.wait(scaled(60))
            snd.send(src, last=True)
            out[room] = (snd.poll().name, snd.reason)
            snd.clear()
        results.put(("prefill", out))
    transport.close()


def ucx_decode(
    url: str,
    ns: str,
    engine: str,
    addr: str,
    rooms: dict[int, list[int]],
    layers: int,
    page_bytes: int,
    dummy: bool,
    results: Queue,
) -> None:
    """A decode rank: publishes destination pages, waits for Success, returns its pool."""
    from transports.ucx import UCXTransport

    store = kvstate.connect(url, namespace=ns)
    transport = UCXTransport()
    pool = _pool(layers, 256, page_bytes, fill=None)
    transport.register_buffers(pool, [page_bytes] * layers)
    with kvstate.KVManager(store, "decode", engine, transport=transport) as mgr:
        rcvs = {}
        for room, dst in rooms.items():
            rcvs[room] = mgr.receiver(room, addr)  # binds the prefill once it registered
            rcvs[room].init([] if dummy else dst, dummy=dummy)
        out = {}
        for room, rcv in rcvs.items():
            deadline = time.monotonic() + scaled(60)
            while rcv.poll() not in (KVPoll.Success, KVPoll.Failed):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            out[room] = rcv.status.name
            rcv.clear()
        results.put(("decode", engine, out, [a.copy() for a in pool]))
    transport.close()


def ucx_decode_hang(
    url: str,
    ns: str,
    engine: str,
    addr: str,
    room: int,
    dst: list[int],
    layers: int,
    page_bytes: int,
    results: Queue,
) -> None:
    """A decode rank that publishes its pages and then waits to be killed."""
    from transports.ucx import UCXTransport

    store = kvstate.connect(url, namespace=ns)
    transport = UCXTransport()
    transport.register_buffers(_pool(layers, 256, page_bytes, fill=None), [page_bytes] * layers)
    mgr = kvstate.KVManager(store, "decode", engine, transport=transport)
    rcv = mgr.receiver(room, addr)
    rcv.init(dst)
    results.put(("published", engine))
    while True:
        time.sleep(1)


def prefill_rank(
    url: str,
    ns: str,
    engine: str,
    addr: str,
    ranks: int,
    lease: float,
    delay: float,
    rooms: list[int],
    results: Queue,
    hold: Event | None = None,
) -> None:
    """A prefill TP rank without a transport: after ``delay`` it registers (waiting for
    its name if a dead predecessor's lease still holds it), serves ``rooms`` (begin /
    finish once its receivers published; after ``hold`` is set, if given), reports
    each step on ``results``, and stays alive until killed."""
    time.sleep(delay)
    store = kvstate.connect(url, namespace=ns)
    deadline = time.monotonic() + scaled(60)
    while True:
        try:
            mgr = kvstate.KVManager(store, "prefill", engine, addr, lease=lease, ranks=ranks)
            break
        except kvstate.EngineNameTakenError:
            if time.monotonic() > deadline:
                raise
            time.sleep(lease / 10)
    results.put(("ready", engine, mgr.incarnation))
    out = {}
    senders = {room: mgr.sender(room) for room in rooms}
    for snd in senders.values():
        deadline = time.monotonic() + scaled(60)
        while snd.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.01)
    if hold is not None:
        results.put(("holding", engine, None))
        hold.wait(scaled(60))
    for room, snd in senders.items():
        if snd.begin_transfer() == KVPoll.Transferring:
            snd.finish_transfer()
        out[room] = (snd.status.name, snd.reason)
    results.put(("done", engine, out))
    while True:
        time.sleep(1)


def stale_owner(url: str, ns: str, engine: str, lease: float, room: int, results: Queue) -> None:
    """A prefill engine with one live room that keeps asking for new senders; the test
    SIGSTOPs it past its lease, lets another process take the name, then SIGCONTs it."""
    store = kvstate.connect(url, namespace=ns)
    mgr = kvstate.KVManager(store, "prefill", engine, lease=lease, heartbeat_interval=lease / 5)
    mgr.sender(room).poll()
    results.put(("ready", mgr.incarnation, None))
    n = room
    while True:
        n += 1
        try:
            mgr.sender(n)
        except kvstate.EngineNameTakenError as exc:
            results.put(("refused", mgr.incarnation, str(exc)))
            break
        time.sleep(lease / 10)
    while True:
        time.sleep(1)


def decode_rank(
    url: str, ns: str, engine: str, addr: str, lease: float, rooms: list[int], results: Queue
) -> None:
    """A decode rank that publishes pages for ``rooms`` and then waits to be killed."""
    store = kvstate.connect(url, namespace=ns)
    mgr = kvstate.KVManager(store, "decode", engine, lease=lease)
    for room in rooms:
        mgr.receiver(room, addr).init([room % 200, room % 200 + 1])
    results.put(("published", engine, mgr.incarnation))
    while True:
        time.sleep(1)
