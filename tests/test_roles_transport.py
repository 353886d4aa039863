"""KVSender.send() moves real pages over UCX between processes; completion via Redis."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.ops.metrics import read_transfer_totals
from kvstate.store import Store
from kvstate.testing import RoundTrips
from tests import workers
from tests.helpers import keys_of, scaled

LAYERS, PAGE = 3, 512
ADDR = "10.1.1.1:8998"


NAMESPACE = "ucx"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server only."""
    return redis_url


def run(
    spawn_ctx,
    url: str,
    rooms_src: dict,
    decoders: list[tuple[str, dict, bool]],
    stats: bool = False,
) -> tuple:
    results = spawn_ctx.Queue()
    pre = spawn_ctx.Process(
        target=workers.ucx_prefill,
        args=(
            url,
            "ucx",
            "prefill-u.tp0",
            ADDR,
            rooms_src,
            len(decoders),
            LAYERS,
            PAGE,
            results,
            None,
            stats,
        ),
    )
    pre.start()
    procs = [pre]
    assert results.get(timeout=scaled(60)) == ("ready", "prefill-u.tp0")
    for engine, rooms_dst, dummy in decoders:
        p = spawn_ctx.Process(
            target=workers.ucx_decode,
            args=(url, "ucx", engine, ADDR, rooms_dst, LAYERS, PAGE, dummy, results),
        )
        p.start()
        procs.append(p)
    got = [results.get(timeout=scaled(120)) for _ in procs]
    for p in procs:
        p.join(scaled(30))
        assert p.exitcode == 0
    prefill = next(g[1] for g in got if g[0] == "prefill")
    decode = {g[1]: (g[2], g[3]) for g in got if g[0] == "decode"}
    return prefill, decode


def check_pages(pool: list, src: list[int], dst: list[int]) -> None:
    for layer in range(LAYERS):
        for s, d in zip(src, dst, strict=True):
            assert np.array_equal(pool[layer][d], workers.expected_page(layer, s, PAGE, 3)), (
                layer,
                s,
                d,
            )


def untouched(pool: list, written: set[int]) -> None:
    for layer in range(LAYERS):
        others = [i for i in range(len(pool[layer])) if i not in written]
        assert not pool[layer][others].any()


def test_contiguous_and_fragmented_pages_arrive_byte_exact(
    store: Store, redis_url: str, spawn_ctx
) -> None:
    rng = np.random.default_rng(7)
    frag_src = sorted(rng.choice(200, 40, replace=False).tolist())
    frag_dst = rng.choice(np.arange(100, 256), 40, replace=False).tolist()
    src = {1: list(range(10, 74)), 2: frag_src}
    dst = {1: list(range(0, 64)), 2: frag_dst}
    prefill, decode = run(spawn_ctx, redis_url, src, [("decode-u.tp0", dst, False)])
    assert prefill == {1: ("Success", ""), 2: ("Success", "")}
    states, pool = decode["decode-u.tp0"]
    assert states == {1: "Success", 2: "Success"}
    check_pages(pool, src[1], dst[1])
    check_pages(pool, src[2], dst[2])
    untouched(pool, set(dst[1]) | set(dst[2]))
    assert keys_of(store) == []


def test_engine_publishes_transfer_counters_for_the_monitor(
    store: Store, redis_url: str, spawn_ctx
) -> None:
    """KVManager(transfer_stats=True): send() counts what the transport moved, and the
    monitor's reader sees it from another process (issue: counters stayed 0)."""
    src = {1: list(range(0, 32)), 2: list(range(40, 50))}
    dst = {1: list(range(100, 132)), 2: list(range(0, 10))}
    prefill, _ = run(spawn_ctx, redis_url, src, [("decode-u.tp0", dst, False)], stats=True)
    assert prefill == {1: ("Success", ""), 2: ("Success", "")}
    totals = read_transfer_totals(store)
    assert list(totals) == ["prefill-u.tp0"]
    assert totals["prefill-u.tp0"].bytes == 42 * LAYERS * PAGE
    assert totals["prefill-u.tp0"].count == 2 and totals["prefill-u.tp0"].seconds > 0
    assert store.client.pttl(store.keys.transfer_stats("prefill-u.tp0")) > 0
    store.client.delete(store.keys.transfer_stats("prefill-u.tp0"))
    assert keys_of(store) == []


def test_two_receivers_and_a_dummy(store: Store, redis_url: str, spawn_ctx) -> None:
    src = {5: [3, 4, 5, 9, 11]}
    a, b = {5: [20, 21, 22, 40, 41]}, {5: [7, 1, 2, 3, 100]}
    prefill, decode = run(
        spawn_ctx,
        redis_url,
        src,
        [
            ("decode-a.tp0", a, False),
            ("decode-b.tp0", b, False),
            ("decode-c.tp0", {5: []}, True),
        ],
    )
    assert prefill[5][0] == "Success"
    for engine, dst in (("decode-a.tp0", a), ("decode-b.tp0", b)):
        states, pool = decode[engine]
        assert states == {5: "Success"}
        check_pages(pool, src[5], dst[5])
        untouched(pool, set(dst[5]))
    states, pool = decode["decode-c.tp0"]
    assert states == {5: "Success"}  # acked, though nothing was written
    untouched(pool, set())
    assert keys_of(store) == []


def test_receiver_killed_before_the_write_fails_the_room_with_a_reason(
    store: Store, redis_url: str, spawn_ctx
) -> None:
    results, go = spawn_ctx.Queue(), spawn_ctx.Event()
    pre = spawn_ctx.Process(
        target=workers.ucx_prefill,
        args=(
            redis_url,
            "ucx",
            "prefill-u.tp0",
            ADDR,
            {9: [1, 2, 3]},
            1,
            LAYERS,
            PAGE,
            results,
            go,
        ),
    )
    pre.start()
    assert results.get(timeout=scaled(60)) == ("ready", "prefill-u.tp0")
    # its own queue: a process SIGKILLed while its queue feeder thread holds the queue's
    # lock would leave a shared queue locked for everyone else
    published = spawn_ctx.Queue()
    dec = spawn_ctx.Process(
        target=workers.ucx_decode_hang,
        args=(redis_url, "ucx", "decode-k.tp0", ADDR, 9, [4, 5, 6], LAYERS, PAGE, published),
    )
    dec.start()
    assert published.get(timeout=scaled(60)) == ("published", "decode-k.tp0")
    dec.kill()  # SIGKILL after publishing, before the sender writes
    dec.join(scaled(10))
    go.set()
    kind, outcome = results.get(timeout=scaled(60))
    assert kind == "prefill"
    status, reason = outcome[9]
    assert status == "Failed" and "transfer failed" in reason
    pre.join(scaled(30))
    assert pre.exitcode == 0
    # the dead receiver never cleared: its room keys carry TTLs (checked by the fixture),
    # and the abort reached them: the receiver's hash says why
    rx = store.client.hgetall(store.keys.participant(9, "rx", "decode-k.tp0"))
    assert rx[b"status"] == b"Failed" and b"transfer failed" in rx[b"reason"]


def test_send_many_writes_the_rooms_together_each_decided_alone(store: Store) -> None:
    """KVManager.send_many: one call writes rooms to two decode engines (one pass per
    receiver), each room answered as its send() would be: the rooms whose receiver
    published are Transferring with their bytes in place (finish_many then acks them),
    a room still Bootstrapping is refused in ``.errors`` with nothing written, and a
    room whose decode engine is gone is Failed with why, its neighbours unharmed. A
    room this manager has no sender for is refused before any byte moves."""
    import kvstate
    from kvstate.errors import KVStateError
    from kvstate.poll import KVPoll
    from transports.ucx import UCXTransport

    transports = [UCXTransport() for _ in range(3)]
    pools = [workers._pool(LAYERS, 64, PAGE, fill=3 if i == 0 else None) for i in range(3)]
    for t, pool in zip(transports, pools, strict=True):
        t.register_buffers(pool, [PAGE] * LAYERS)
    p = kvstate.KVManager(store, "prefill", "prefill-m.tp0", ADDR, transport=transports[0])
    a = kvstate.KVManager(store, "decode", "decode-a.tp0", transport=transports[1])
    b = kvstate.KVManager(store, "decode", "decode-b.tp0", transport=transports[2])
    try:
        src = {1: [1, 2, 3], 2: [10, 12, 14], 3: [20, 21], 4: [30, 31, 32, 33], 5: [40]}
        dst = {1: [5, 6, 7], 2: [9, 8, 1], 3: [40, 41], 4: [12, 13, 14, 15], 5: [50]}
        engine_of = {1: a, 2: a, 3: b, 4: b, 5: a}
        senders = {r: p.sender(r) for r in src}
        receivers = {r: engine_of[r].receiver(r, ADDR) for r in src if r != 5}
        for r, rcv in receivers.items():
            assert rcv.init(dst[r]) == KVPoll.WaitingForInput
        for snd in senders.values():
            snd.poll()
        with pytest.raises(KVStateError, match="no live participant"):
            p.send_many({1: src[1], 99: [1]})
        with pytest.raises(KVStateError, match="a prefill manager's senders"):
            a.send_many({1: src[1]})
        assert senders[1].status == KVPoll.WaitingForInput  # refused whole: nothing begun
        b.close()  # decode-b's registration (endpoint, layout) is gone: rooms 3 and 4 fail
        with RoundTrips.installed() as rt:
            before = rt.by_thread["MainThread"]
            res = p.send_many(src)
            trips = rt.by_thread["MainThread"] - before
        # a begin per room not begun yet (4), each decode engine's registration (2), and
        # the two rooms whose transfer failed aborted together: 3 (one by one: 6)
        assert trips == 4 + 2 + 3, trips
        assert res == {1: KVPoll.Transferring, 2: KVPoll.Transferring} | {
            3: KVPoll.Failed,
            4: KVPoll.Failed,
        }
        assert list(res.errors) == [5] and "before every receiver published" in str(res.errors[5])
        for r in (3, 4):
            assert "transfer failed" in (senders[r].reason or "")
        assert senders[5].status == KVPoll.Bootstrapping  # nothing written for it
        assert senders[1].moved == 3 * LAYERS * PAGE and senders[5].moved == 0
        assert p.finish_many([1, 2]) == {1: KVPoll.Success, 2: KVPoll.Success}
        for r in (1, 2):
            assert receivers[r].poll() == KVPoll.Success
        pool = pools[1]
        for layer in range(LAYERS):
            for r in (1, 2):
                for s, d in zip(src[r], dst[r], strict=True):
                    assert np.array_equal(pool[layer][d], workers.expected_page(layer, s, PAGE, 3))
        untouched(pool, set(dst[1]) | set(dst[2]))
        assert not any(pools[2][layer].any() for layer in range(LAYERS))  # b's: nothing
        p.clear_many(p.live_rooms)
        a.clear_many(a.live_rooms)
        for r in (3, 4):  # decode-b's manager is closed: its keys go through the Store
            store.clear(r, "rx", "decode-b.tp0", senders=receivers[r].senders, peer_addr=ADDR)
    finally:
        for mgr in (p, a, b):
            mgr.close()
        for t in transports:
            t.close()
    assert keys_of(store) == []
