"""Design rule 7: bad input raises a specific error and leaves the stored state as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import redis

import kvstate
from kvstate import KVPoll, schema
from kvstate.errors import (
    CorruptStateError,
    InvalidIndicesError,
    InvalidNameError,
    InvalidRoomError,
    InvalidStatusError,
    InvalidURLError,
    InvalidValueError,
    StateConnectionError,
)
from kvstate.store import Store
from tests.helpers import PREFILL_ADDR, managers, scaled, snapshot

NAMESPACE = "bad"  # of the ``store`` fixture (tests/conftest.py)


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server only."""
    return redis_url


BAD_ROOMS = [None, -1, 1.5, 2**63, 2**70, "3", True, b"3"]


@pytest.mark.parametrize("room", BAD_ROOMS, ids=repr)
def test_bad_rooms_are_refused_everywhere(store: Store, room: object) -> None:
    p, d = managers(store)
    with p, d:
        before = snapshot(store)
        with pytest.raises(InvalidRoomError):
            p.sender(room)
        with pytest.raises(InvalidRoomError):
            d.receiver(room, PREFILL_ADDR)
        with pytest.raises(InvalidRoomError):
            p.poll_many([1, room])
        with pytest.raises(InvalidRoomError):
            store.abort(room, "x")  # type: ignore[arg-type]
        # the calls run behind the step refuse before anything runs, not in their Future
        with pytest.raises(InvalidRoomError):
            p.finish_many([room], clear=True, wait=False)
        with pytest.raises(InvalidRoomError):
            d.clear_many([room], wait=False)
        with pytest.raises(InvalidValueError, match="later=True"):
            d.clear_many([1], later=True, wait=False)  # type: ignore[call-overload]
        assert snapshot(store) == before


def test_unknown_status(store: Store) -> None:
    p, d = managers(store)
    with p, d:  # d too: a manager left open heartbeats into later tests' servers
        snd = p.sender(1)
        snd.poll()
        before = snapshot(store)
        for bad in ("Done", 7, -1, None, 2.0):
            with pytest.raises(InvalidStatusError):
                store.update(1, "tx", p.engine, bad)  # type: ignore[arg-type]
        assert snapshot(store) == before
        snd.clear()


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://h:1",
        "redis://",
        "redis://h:99999",
        "redis://h/notadb",
        "unix://",
        "redis+cluster:///x",
        "redis://h:-1",
    ],
)
def test_malformed_urls(url: str) -> None:
    with pytest.raises(InvalidURLError):
        kvstate.connect(url)


@pytest.mark.parametrize("ns", ["", "a b", "x{1}", "ns*", "é", "a" * 65, "a:b"])
def test_odd_namespaces(redis_url: str, ns: str) -> None:
    with pytest.raises(InvalidNameError):
        kvstate.connect(redis_url, namespace=ns)


def test_wrong_password_names_no_password(redis_server_factory) -> None:
    proc = redis_server_factory(password="s3cret-pw")
    assert "s3cret-pw" in proc.unix_url
    url = proc.unix_url.replace("s3cret-pw", "wrong-Pa55")
    with pytest.raises(StateConnectionError) as info:
        kvstate.connect(url)
    text = str(info.value) + repr(info.value)
    assert "authentication" in text
    assert "wrong-Pa55" not in text and "s3cret-pw" not in text
    tcp = f"redis://:wrong-Pa55@127.0.0.1:{proc.port}/0" if proc.port else None
    if tcp:
        with pytest.raises(StateConnectionError) as info2:
            kvstate.connect(tcp)
        assert "wrong-Pa55" not in str(info2.value)
    good = kvstate.connect(proc.unix_url)
    assert "s3cret-pw" not in repr(good) and "***" in good.url
    good.close()


@pytest.mark.parametrize(
    "value",
    [
        b"\xc1garbage",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 99}),
        msgpack.packb({"v": 1, "kv": 5}),
    ],
)
def test_corrupt_transfer_info(store: Store, redis_cli, redis_url: str, value: bytes) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(2)
        rcv = d.receiver(2, PREFILL_ADDR)
        rcv.init([1, 2, 3])
        key, field = store.keys.room_hash(2), schema.xfer_field(p.engine, d.engine)
        store.client.hset(key, field, value)  # "written by hand"
        snd.poll()
        before = snapshot(store)
        with pytest.raises(CorruptStateError) as info:
            snd.transfer_infos()
        assert info.value.key == key and info.value.field == field
        assert snapshot(store) == before
        snd.clear()
        rcv.clear()


def test_corrupt_status_written_with_redis_cli(store: Store, redis_cli, redis_url: str) -> None:
    p, d = managers(store)
    with p, d:
        snd = p.sender(3)
        snd.poll()
        key = store.keys.participant(3, "tx", p.engine)
        redis_cli(redis_url, "HSET", key, "status", "Exploded")
        before = snapshot(store)
        for op in (snd.poll, snd.begin_transfer, lambda: snd.fail("x")):
            with pytest.raises(CorruptStateError) as info:
                op()
            assert info.value.key == key and info.value.field == "status"
        assert snapshot(store) == before
        redis_cli(redis_url, "DEL", key)
        store.client.set(key, "not a hash")
        store.client.expire(key, 60)
        with pytest.raises(CorruptStateError):
            store.execute([store.poll(3, "tx", p.engine)])
        snd.clear()


@pytest.mark.parametrize("rate", [0.0, 1.0], ids=["untraced", "traced"])
def test_room_hash_of_another_type_at_publish(redis_url: str, rate: float) -> None:
    """A room hash that is not a hash, met by init()'s publish.lua: CorruptStateError
    naming it, and nothing written, no trace entry either. Untraced, the script does
    not read the room hash first when no sender needs its count (issue 22): its first
    write is the check; traced, the read still goes first."""
    store = kvstate.connect(
        redis_url, namespace="badroom", options=kvstate.Options(trace_rate=rate)
    )
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(5, PREFILL_ADDR)
        assert rcv.poll() == KVPoll.Bootstrapping  # created and bound, nothing published
        room = store.keys.room_hash(5)
        store.client.delete(room)
        store.client.set(room, "not a hash", px=60_000)
        before = snapshot(store)
        with pytest.raises(CorruptStateError) as info:
            rcv.init([1, 2, 3])
        assert info.value.key == room
        assert snapshot(store) == before
        store.client.delete(room)
        rcv.clear()
    store.close()


@pytest.mark.parametrize(
    "indices", [[-1, 2], [1.5, 2.0], [[1, 2]], ["a"], [2**31], [True, False]], ids=repr
)
def test_bad_index_arrays(store: Store, indices: object) -> None:
    p, d = managers(store)
    with p, d:
        rcv = d.receiver(4, PREFILL_ADDR)
        before = snapshot(store)
        with pytest.raises(InvalidIndicesError):
            rcv.init(indices)
        assert snapshot(store) == before


def test_engine_and_addr_names_checked(store: Store) -> None:
    with pytest.raises(InvalidNameError):
        kvstate.KVManager(store, "prefill", "bad engine")
    with pytest.raises(InvalidNameError):
        kvstate.KVManager(store, "decode", "ok", bootstrap_addr="host:{1}")
    with pytest.raises(ValueError):
        kvstate.KVManager(store, "router", "ok")


def test_no_url_is_an_error_naming_the_variable(tmp_path) -> None:
    """No URL anywhere: a library connect() refuses at once (an engine missing
    $KVSTATE_REDIS_URL would otherwise run alone on a server nobody else sees), starts
    no redis-server, and leaves the environment as it was."""
    code = (
        "import kvstate, os\n"
        "try:\n"
        "    kvstate.connect()\n"
        "except kvstate.InvalidURLError as exc:\n"
        "    print(exc)\n"
        "print('KVSTATE_REDIS_URL' in os.environ)\n"
        "def ppid(p):\n"
        "    try:\n"
        "        return open(f'/proc/{p}/stat').read().rpartition(')')[2].split()[1]\n"
        "    except OSError:\n"
        "        return ''\n"
        "print([p for p in os.listdir('/proc') if p.isdigit() and ppid(p) == str(os.getpid())])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=True,
    ).stdout.splitlines()
    assert "no Redis URL" in out[0] and "$KVSTATE_REDIS_URL" in out[0], out
    assert "connect('embedded')" in out[0], out
    assert out[1:] == ["False", "[]"], out  # no child: no redis-server was started


def test_embedded_by_name_from_a_clean_environment(tmp_path) -> None:
    """connect("embedded") starts a private redis-server, does not publish it in the
    environment, and it is gone after the process exits."""
    code = (
        "import kvstate, os\n"
        "s = kvstate.connect('embedded')\n"
        "print(s.url)\n"
        "m = kvstate.KVManager(s, 'prefill', 'p0')\n"
        "snd = m.sender(1); print(snd.poll().name); snd.clear(); m.close()\n"
        "print(kvstate.connect('embedded').url == s.url)\n"  # one per process
        "print(os.environ.get('KVSTATE_REDIS_URL'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=True,
    ).stdout.split()
    assert out[0].startswith("unix://") and out[1:] == ["Bootstrapping", "True", "None"], out
    sock = out[0][len("unix://") :]
    assert not os.path.exists(sock)  # the server stopped with its owner
    with pytest.raises(redis.ConnectionError):
        redis.Redis(unix_socket_path=sock).ping()


def test_kvpoll_values_match_sglang() -> None:
    assert [int(s) for s in KVPoll] == [0, 1, 2, 3, 4]
    assert KVPoll.parse("Transferring") is KVPoll.Transferring
