"""Redis memory per in-flight room: the slope of INFO used_memory over held rooms."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import redis

import kvstate
from kvstate.store import Store

HELD_ROOMS = (1024, 4096)
# Room ids of 19 digits, as engines draw them (random in [0, 2**63): the demo, SGLang):
# every per-room key name and the tracker's member carry the id.
HELD_ROOM_BASE = 2**62


def _settled_used_memory(c: redis.Redis) -> int:
    """INFO used_memory once the key dicts' incremental rehash is done: an expansion
    allocates the new bucket array at once and frees the old one only at the end (the
    server's cron finishes it in a few ticks), so the figure must hold still for 1 s."""
    last, still = -1, 0
    for _ in range(100):
        used = int(c.info("memory")["used_memory"])
        still = still + 1 if used == last else 0
        if still == 10:
            break
        last = used
        time.sleep(0.1)
    return last


def _memory_usage(store: Store, key: str) -> int:
    node: Any = store.client
    if store.cluster:
        node = node.get_node_from_key(key).redis_connection
    return int(node.memory_usage(key, samples=0) or 0)


def _memory_sample(store: Store, nodes: list[redis.Redis], trackers: list[str]) -> dict[str, float]:
    """used_memory, the keyspace's hash tables (MEMORY STATS: dict entries and bucket
    arrays of the key and expiry dicts, the values' robj), the address tracker's MEMORY
    USAGE (its shards', issue 33), the clients' buffers (in used_memory, not the rooms':
    noise) and the key count, summed over the primaries."""
    sample = {
        "used_memory": float(sum(_settled_used_memory(c) for c in nodes)),
        "client_buffers": float(sum(int(c.info("memory")["mem_clients_normal"]) for c in nodes)),
        "address_tracker": float(sum(_memory_usage(store, t) for t in trackers)),
        "hashtables": 0.0,
        "keys": float(sum(int(c.dbsize()) for c in nodes)),
    }
    for c in nodes:
        db = c.memory_stats().get("db.0", {})
        sample["hashtables"] += float(db.get("overhead.hashtable.main", 0))
        sample["hashtables"] += float(db.get("overhead.hashtable.expires", 0))
    return sample


def held_room_memory(
    store: Store,
    nodes: list[redis.Redis],
    p: kvstate.KVManager,
    d: kvstate.KVManager,
    pages: np.ndarray,
    counts: tuple[int, int] = HELD_ROOMS,
) -> dict[str, Any]:
    """Redis memory per in-flight room as the slope of INFO used_memory between two
    counts of rooms held in WaitingForInput (both sides published, 4096 contiguous
    pages, 19-digit room ids), in one run: what the rooms cost the server. MEMORY
    USAGE of a room's keys (beside it) leaves out their expiry entries, the key dicts'
    buckets and the room's member of its address tracker. Beside the slope, those
    parts' own slopes and each key of one held room: MEMORY USAGE, encoding, fields.
    A room's trace (kept for the share Options.trace_rate of rooms) is in the slope at
    that share (keys_per_room shows it), listed with the keys when this room has one,
    and left out of the MEMORY USAGE sum, which is a room's state."""
    base, held = HELD_ROOM_BASE, 0
    samples: list[dict[str, float]] = []
    trackers = store.keys.trackers(p.bootstrap_addr)
    for target in counts:
        while held < target:
            chunk = list(range(base + held, base + min(held + 256, target)))
            for r in chunk:
                d.receiver(r, p.bootstrap_addr)
                p.sender(r)
            d.init_many(dict.fromkeys(chunk, pages))
            ready = p.poll_many(chunk)
            assert set(ready.values()) == {kvstate.KVPoll.WaitingForInput}, ready
            held += len(chunk)
        samples.append(_memory_sample(store, nodes, trackers))
    keys: dict[str, dict[str, Any]] = {}
    for key in sorted(store.scan(store.keys.room_prefix(base) + "*")):
        node: Any = store.client
        if store.cluster:
            node = node.get_node_from_key(key).redis_connection
        parsed = store.keys.parse_room_key(key)
        keys[parsed.kind if parsed else key] = {
            "bytes": int(node.memory_usage(key, samples=0) or 0),
            "encoding": node.object("encoding", key).decode(),
            "fields": int(node.hlen(key)) if node.type(key) == b"hash" else None,
            "name_length": len(key),
        }
    for start in range(base, base + held, 256):
        chunk = list(range(start, min(start + 256, base + held)))
        p.clear_many(chunk)
        d.clear_many(chunk)
    lo, hi = samples
    rooms = counts[1] - counts[0]

    def slope(name: str) -> float:
        return round((hi[name] - lo[name]) / rooms, 1)

    return {
        "held_rooms": list(counts),
        "used_memory": [int(lo["used_memory"]), int(hi["used_memory"])],
        "used_memory_bytes_per_room": slope("used_memory"),
        "memory_usage_bytes_per_room": sum(v["bytes"] for k, v in keys.items() if k != "trace"),
        "keys_per_room": round((hi["keys"] - lo["keys"]) / rooms, 3),
        "key_and_expiry_dicts_bytes_per_room": slope("hashtables"),
        "address_tracker_bytes_per_room": slope("address_tracker"),
        "client_buffers_bytes_per_room": slope("client_buffers"),
        "keys": keys,
    }
