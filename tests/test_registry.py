"""register.lua / index.lua: one owner per engine name, and the address index, on real
Redis (standalone and a 3-primary Cluster)."""

from __future__ import annotations

import os
import socket
import time

import pytest

import kvstate
from kvstate.errors import CorruptStateError, EngineNameTakenError
from kvstate.registry import EngineInfo, Registry
from kvstate.store import Store
from tests.helpers import keys_of, wait_for

ADDR = "10.3.3.3:8998"


NAMESPACE = "reg"  # of the ``store`` fixture (tests/conftest.py)
CHECK_TTL = True  # ``store`` checks every key has a TTL after each test (rule 1)


def info(engine: str, inc: str, addr: str = ADDR, role: str = "prefill") -> EngineInfo:
    return EngineInfo(engine=engine, role=role, addr=addr, incarnation=inc)


def test_register_renew_drop_answers(store: Store) -> None:
    reg = Registry(store)
    a, b = info("p.tp0", "inc-a"), info("p.tp0", "inc-b")
    assert reg.claim(a, 5.0, "register").answer == "registered"
    assert reg.claim(a, 5.0, "register").answer == "registered"  # a retried call
    assert reg.renew(a, 5.0).answer == "renewed"
    # a second incarnation is refused, named, and changes nothing
    pttl = store.client.pttl(store.keys.engine("p.tp0"))
    taken = reg.renew(b, 60.0)
    assert (taken.answer, taken.holder) == ("taken", "inc-a")
    assert (taken.host, taken.pid) == (socket.gethostname(), str(os.getpid()))
    assert reg.claim(b, 60.0, "register").answer == "taken"
    with pytest.raises(EngineNameTakenError) as err:
        reg.register(b, 60.0)
    assert "inc-a" in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    assert reg.get("p.tp0").incarnation == "inc-a"  # type: ignore[union-attr]
    assert store.client.pttl(store.keys.engine("p.tp0")) <= pttl  # not extended by b
    assert not reg.drop("p.tp0", "inc-b", ADDR)  # not b's to drop
    assert reg.get("p.tp0") is not None
    # a lapsed lease: renew registers again, whole
    store.client.delete(store.keys.engine("p.tp0"))
    assert reg.renew(a, 5.0).answer == "lapsed"
    assert reg.get("p.tp0").incarnation == "inc-a"  # type: ignore[union-attr]
    assert reg.drop("p.tp0", "inc-a", ADDR)
    assert reg.get("p.tp0") is None and not reg.drop("p.tp0", "inc-a", ADDR)
    # the name is free again
    assert reg.claim(b, 5.0, "register").answer == "registered"
    assert reg.drop("p.tp0", "inc-b", ADDR)
    assert keys_of(store) == []


def test_address_index_finds_engines_without_scan(store: Store) -> None:
    reg = Registry(store)
    for i, name in enumerate(["p.tp1", "p.tp0", "d.tp0"]):
        reg.register(info(name, f"i{i}", role="decode" if name[0] == "d" else "prefill"), 1.0)
    reg.register(info("q.tp0", "i9", addr="10.9.9.9:1"), 1.0)
    assert [e.engine for e in reg.at_addr(ADDR, role="prefill")] == ["p.tp0", "p.tp1"]
    assert [e.engine for e in reg.at_addr(ADDR)] == ["d.tp0", "p.tp0", "p.tp1"]
    assert 0 < store.client.pttl(store.keys.engines_at(ADDR)) <= 1000
    # the registration decides: an index entry whose engine is gone is not returned
    store.client.delete(store.keys.engine("p.tp1"))
    assert [e.engine for e in reg.at_addr(ADDR, role="prefill")] == ["p.tp0"]
    for name, inc in (("p.tp0", "i1"), ("d.tp0", "i2")):
        assert reg.drop(name, inc, ADDR)
    assert reg.drop("q.tp0", "i9", "10.9.9.9:1")
    # p.tp1's entry outlives its key only until its deadline: the index key has the TTL
    assert wait_for(lambda: not store.client.exists(store.keys.engines_at(ADDR)), 3.0)
    assert keys_of(store) == []


def test_short_lease_leaves_the_index(store: Store) -> None:
    reg = Registry(store)
    reg.register(info("p.tp0", "i0"), 0.3)
    assert wait_for(lambda: reg.at_addr(ADDR) == [], 3.0)
    assert wait_for(lambda: keys_of(store) == [], 3.0)


def test_second_manager_with_a_live_name_is_refused(store: Store) -> None:
    with kvstate.KVManager(store, "prefill", "p.tp0", ADDR, lease=1.0) as first:
        with pytest.raises(EngineNameTakenError) as err:
            kvstate.KVManager(store, "prefill", "p.tp0", ADDR, lease=1.0)
        text = str(err.value)
        assert socket.gethostname() in text and f"pid {os.getpid()}" in text
        assert first.incarnation in text and "own engine name" in text
        # the refused one displaced nothing, for several heartbeats
        for _ in range(3):  # an absence: nothing to poll for, so look after each period
            time.sleep(first.heartbeat_interval)
            assert first.registry.get("p.tp0").incarnation == first.incarnation  # type: ignore[union-attr]
    # once closed the name is free at once
    with kvstate.KVManager(store, "prefill", "p.tp0", ADDR, lease=1.0) as again:
        assert again.registry.get("p.tp0").incarnation == again.incarnation  # type: ignore[union-attr]
    assert keys_of(store) == []


# --------------------------------------------------------------------------- decoding


def _as_stored(fields: dict[str, object]) -> dict[bytes, bytes]:
    """What HGETALL returns for ``fields`` written with HSET."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def test_engine_info_round_trips_as_stored() -> None:
    full = EngineInfo(
        engine="p.tp3",
        role="prefill",
        addr=ADDR,
        incarnation="inc-9",
        endpoint=b"\x00ucx-address\xff",
        layout={"layers": [[4096, 64]], "page_bytes": 4096},
        gpus=[{"index": 0, "uuid": "GPU-1"}],
        ranks=4,
    )
    back = EngineInfo.decode("k", "p.tp3", _as_stored(full.fields()), 1234)
    assert back == EngineInfo(**{**full.__dict__, "lease_left_ms": 1234})
    # written by an older kvstate: no ranks field means one rank
    old = _as_stored({k: v for k, v in full.fields().items() if k != "ranks"})
    assert EngineInfo.decode("k", "p.tp3", old, 5).ranks == 1


@pytest.mark.parametrize(
    "change",
    [
        {"pid": None},
        {"role": None},
        {"pid": b"not-a-pid"},
        {"ranks": b"many"},
        {"host": b"\xff\xfe"},
        {"layout": b"not msgpack"},
        {"gpus": None},
    ],
)
def test_incomplete_or_corrupt_registration_is_corrupt_state(change: dict[str, object]) -> None:
    stored = _as_stored(info("p.tp0", "i0").fields())
    for name, value in change.items():
        if value is None:
            del stored[name.encode()]
        else:
            stored[name.encode()] = value  # type: ignore[assignment]
    with pytest.raises(CorruptStateError) as err:
        EngineInfo.decode("kvstate:reg:engine:p.tp0", "p.tp0", stored, 10)
    assert err.value.key == "kvstate:reg:engine:p.tp0"


def test_all_and_incarnations(store: Store) -> None:
    reg = Registry(store)
    reg.register(info("p.tp0", "i0"), 5.0)
    reg.register(info("d.tp0", "i1", addr="10.4.4.4:1", role="decode"), 5.0)
    assert [(e.engine, e.role) for e in reg.all()] == [("d.tp0", "decode"), ("p.tp0", "prefill")]
    assert all(0 < e.lease_left_ms <= 5000 for e in reg.all())
    got = reg.incarnations(["p.tp0", "gone", "d.tp0"])
    assert got == {"p.tp0": "i0", "gone": None, "d.tp0": "i1"}
    assert reg.drop("p.tp0", "i0", ADDR) and reg.drop("d.tp0", "i1", "10.4.4.4:1")
    assert reg.all() == [] and keys_of(store) == []
