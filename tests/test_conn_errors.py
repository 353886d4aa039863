"""The connection layer says what went wrong, quickly, against real servers: URL query
parameters (supported ones work, others are one clear InvalidURLError), TLS against a
plain port, a bad argument reaching Redis, a Cluster slot left mid-migration, and a
clear() at maxmemory (it must always work: it frees memory)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

import kvstate
from kvstate import KVPoll, Options
from kvstate.errors import (
    InvalidArgumentError,
    InvalidURLError,
    StateConnectionError,
    StateOutOfMemoryError,
)
from kvstate.ops.monitor import Monitor
from kvstate.store import Store, command_call
from kvstate.testing import RedisCluster, RedisProcess
from tests.helpers import PREFILL_ADDR, keys_of, managers, scaled

# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "query, says",
    [
        ("foo=bar", "unknown parameter 'foo'"),
        ("socket_timeout=abc", "bad value 'abc' for 'socket_timeout'"),
        ("socket_timeout=-1", "number of seconds > 0"),
        ("call_timeout=inf", "number of seconds > 0"),
        ("cluster=maybe", "use true or false"),
        ("retries=x", "integer >= 0"),
        ("db=1&db=2", "more than once"),
        ("db=x", "integer >= 0"),
        ("ssl_ca_certs=/ca.pem", "needs TLS"),
        ("password=Secret-pw", "unknown parameter 'password'"),
        ("cluster=true&db=3", "only database 0"),
        ("a=1&&b", "malformed query"),
    ],
)
def test_bad_url_parameters_are_one_clear_line(redis_tcp_url: str, query: str, says: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidURLError) as info:
        kvstate.connect(f"{redis_tcp_url}?{query}")
    text = str(info.value)
    assert says in text, text
    assert "\n" not in text and "Secret-pw" not in text
    assert time.monotonic() - t0 < scaled(1.0)


def test_supported_url_parameters_work(redis_tcp_url: str, redis_proc: RedisProcess) -> None:
    url = f"{redis_tcp_url}?socket_timeout=2&connect_timeout=1.5&call_timeout=4&retries=1&db=3"
    store = kvstate.connect(url, namespace="params", options=Options(retries=7))
    o = store.options
    assert (o.socket_timeout, o.connect_timeout, o.call_timeout, o.retries) == (2, 1.5, 4, 1)
    p = kvstate.KVManager(store, "prefill", "p0")
    snd = p.sender(1)
    assert snd.poll() == KVPoll.Bootstrapping
    with redis_proc.client(db=3) as c:  # ?db=3 reached redis-py
        assert c.exists(store.keys.participant(1, "tx", "p0")) == 1
    with redis_proc.client(db=0) as c:
        assert c.exists(store.keys.participant(1, "tx", "p0")) == 0
    snd.clear()
    p.close()
    store.close()


@pytest.mark.cluster
def test_cluster_true_parameter(redis_cluster_url: str, redis_tcp_url: str) -> None:
    plain = redis_cluster_url.replace("redis+cluster://", "redis://")
    store = kvstate.connect(f"{plain}?cluster=true", namespace="params")
    assert store.cluster
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(5), d.receiver(5, PREFILL_ADDR)
        rcv.init([1])
        assert snd.begin_transfer() == KVPoll.Transferring
        snd.finish_transfer()
        assert rcv.poll() == KVPoll.Success
        snd.clear()
        rcv.clear()
    store.close()
    with pytest.raises(StateConnectionError, match="is not a Cluster"):
        kvstate.connect(f"{redis_tcp_url}?cluster=true")


@pytest.mark.cluster
@pytest.mark.parametrize(
    "form, cluster",
    [
        ("redis://{hp}/0", True),
        ("redis+cluster://{hp}/0", None),
        ("redis://{hp}/0?cluster=true", None),
        ("redis://{hp}?db=0&cluster=1", None),
    ],
)
def test_cluster_urls_with_database_0(
    redis_cluster_url: str, form: str, cluster: bool | None
) -> None:
    """A Cluster URL written the usual way (with /0, a Cluster's only database) works
    end to end: every client kvstate makes from it (the heartbeat's own, the monitor's
    subscriptions) takes it, not only the first."""
    url = form.format(hp=redis_cluster_url.partition("://")[2])
    store = kvstate.connect(url, namespace="db0", cluster=cluster)
    assert store.cluster
    p = kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR, lease=1.0)
    d = kvstate.KVManager(store, "decode", "d0", "10.0.0.2:8998", lease=1.0)
    with p, d:
        snd, rcv = p.sender(5), d.receiver(5, PREFILL_ADDR)
        rcv.init([1])
        assert snd.begin_transfer() == KVPoll.Transferring
        snd.finish_transfer()
        assert rcv.poll() == KVPoll.Success
        time.sleep(1.5)  # past one lease: only the heartbeats (own clients) kept them
        for m in (p, d):
            info = m.registry.get(m.engine)
            assert info is not None and info.incarnation == m.incarnation
        mon = Monitor(store, interval=0.1)
        assert "notifications on" in mon.start()  # a subscription per primary
        mon.sweep()
        assert len(mon.known) == 2
        mon.events.close()
        snd.clear()
        rcv.clear()
    assert keys_of(store) == []
    store.close()


def test_tls_against_a_plain_port_fails_fast(redis_tcp_url: str) -> None:
    """rediss:// to a plain redis-server: the TLS handshake would wait for an answer
    that never comes; kvstate asks first and says so at once."""
    url = redis_tcp_url.replace("redis://", "rediss://")
    t0 = time.monotonic()
    with pytest.raises(StateConnectionError) as info:
        kvstate.connect(url)
    took = time.monotonic() - t0
    assert "does not speak TLS" in str(info.value) and "redis://" in str(info.value)
    assert took < scaled(3.0), took
    print(f"\n[tls-plain-port] refused_after_s={took:.2f}")


def test_tls_url_with_parameters(redis_tls_url: str) -> None:
    store = kvstate.connect(
        f"{redis_tls_url}&call_timeout=3&ssl_cert_reqs=required", namespace="tls"
    )
    assert store.options.call_timeout == 3
    store.ping()
    store.close()


# --------------------------------------------------------------------------- arguments


NAMESPACE = "args"  # of the ``store`` fixture (tests/conftest.py)


@pytest.fixture
def store_url(redis_url: str) -> str:
    """``store`` on the standalone server only."""
    return redis_url


def test_bad_reason_is_a_specific_error(store: Store) -> None:
    p, d = managers(store)
    with p, d:
        snd, rcv = p.sender(1), d.receiver(1, PREFILL_ADDR)
        rcv.init([1])
        snd.poll()
        for bad in (3, b"x"):  # None is SGLang's "no reason": see test_shapes
            with pytest.raises(InvalidArgumentError, match="reason must be text"):
                rcv.fail(bad)  # type: ignore[arg-type]
        for bad in (None, 3, b"x"):
            with pytest.raises(InvalidArgumentError):
                store.abort(1, bad)  # type: ignore[arg-type]
        assert rcv.poll() == KVPoll.WaitingForInput and snd.poll() == KVPoll.WaitingForInput
        # any value redis-py cannot encode, on any path: refused before it is sent
        with pytest.raises(InvalidArgumentError, match="Redis cannot store"):
            store.execute([command_call("HSET", store.keys.room_hash(1), args=["f", None])])
        with pytest.raises(InvalidArgumentError):
            store.execute(
                [
                    store.poll(1, "tx", p.engine),
                    command_call("HSET", store.keys.room_hash(1), args=["f", {}]),
                ]
            )
        snd.clear()
        rcv.clear()
    assert keys_of(store) == []


# --------------------------------------------------------------------------- Cluster slot


@pytest.mark.cluster
def test_slot_left_mid_migration_says_so(
    redis_cluster_url: str, redis_cluster: RedisCluster
) -> None:
    """A slot marked MIGRATING on its owner (a resharding interrupted): new keys in it
    are redirected with ASK forever; the error names the migration and the fix."""
    store = kvstate.connect(redis_cluster_url, namespace="mig")
    room = 7
    key = store.keys.participant(room, "tx", "p0")
    owner = redis_cluster.node_for_key(key)
    other = next(n for n in redis_cluster.primaries() if n.port != owner.port)
    slot = int(store.client.keyslot(key))  # type: ignore[union-attr]
    with owner.client() as c:
        c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", redis_cluster.node_id(other))
    try:
        p = kvstate.KVManager(store, "prefill", "p0")
        snd = p.sender(room)
        t0 = time.monotonic()
        with pytest.raises(StateConnectionError) as info:
            snd.poll()
        took = time.monotonic() - t0
        text = str(info.value)
        assert f"slot {slot}" in text and "being migrated" in text, text
        assert "redis-cli --cluster fix" in text
        assert took < scaled(10.0)
        print(f"\n[slot-migrating] error_after_s={took:.2f}")
    finally:
        with owner.client() as c:
            c.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert snd.poll() == KVPoll.Bootstrapping
    snd.clear()
    p.close()
    store.close()


# --------------------------------------------------------------------------- maxmemory


def test_clear_works_at_maxmemory(redis_server_factory: Callable[..., RedisProcess]) -> None:
    """At maxmemory (noeviction) Redis refuses every command queued in a MULTI, DEL
    included; clear() must still drain the rooms, on a real server at a tiny limit."""
    proc = redis_server_factory(port="auto")
    store = kvstate.connect(proc.unix_url, namespace="oom")
    p, d = managers(store, lease=30.0)
    made = []
    for room in range(5):  # the first two cleared one by one, the others by a batch
        snd, rcv = p.sender(room), d.receiver(room, PREFILL_ADDR)
        rcv.init([1, 2, 3])
        snd.poll()
        made += [snd, rcv]
    with proc.client() as admin:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        try:
            with pytest.raises(StateOutOfMemoryError):
                p.sender(99).poll()  # writes that need memory are refused
            with pytest.raises(redis.OutOfMemoryError):  # what clear() used to send
                pipe = admin.pipeline(transaction=True)
                pipe.delete(store.keys.participant(0, "tx", p.engine))
                pipe.execute()
            for part in made[:4]:
                part.clear()
            # clears riding a step's batch (clear_many(later=True)): the batch alone,
            # then the clears without the transaction
            p.clear_many([2, 3, 4], later=True)
            with pytest.raises(StateOutOfMemoryError):
                p.poll_changed()  # sender 99's create refused again; the clears made
            d.clear_many([2, 3, 4], later=True)
            d.poll_many([])
            assert p.clearing == [] and d.clearing == [] and all(x.cleared for x in made)
            left = [k for k in keys_of(store) if ":engine:" not in k and ":engines_at:" not in k]
            assert left == [], left
        finally:
            admin.config_set("maxmemory", "0")
    p.close()
    d.close()
    assert keys_of(store) == []
    store.close()
