"""Tenants sharing one Redis (issue 30, item 1): no namespace's engine user can change,
shadow or pre-load the code another namespace's engines run.

On Redis 7 the scripts are one server-wide FUNCTION library, which runs with each
caller's rights: whoever may FUNCTION LOAD could replace it (REPLACE) or load a library
of its name first, and a receiver of another tenant, with its own user and namespace,
would read whatever that code answers. So the engine user of docs/security.md may not FUNCTION
LOAD (an admin loads the library: `kvstate functions load`), and a node runs the
scripts by FCALL only once FUNCTION LIST ... WITHCODE showed kvstate's exact code there;
else by EVALSHA, whose scripts are named by their content. Each attack below is
planted the way an attacker would, with the forged code answering Success to every
call: a test fails if any tenant ever reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

import kvstate
from kvstate import KVPoll
from kvstate.store import functions
from kvstate.testing import RedisProcess
from tests.helpers import (
    ACL_PASSWORD,
    PREFILL_ADDR,
    engine_acl,
    load_functions,
    redis_major,
    setuser,
    user_url,
)

TENANTS = ("alpha", "beta")


def forged(squat: bool = False) -> str:
    """kvstate's own library with one change: every poll answers Success. Named as
    kvstate's library, or (``squat``) as another library that takes kvstate's function
    names (FUNCTION LOAD of kvstate's then fails: function names are server-wide)."""
    poll = f"function_name = '{functions.FUNCTIONS['poll']}', callback = function(keys, argv)\n"
    assert poll in functions.LIBRARY
    text = functions.LIBRARY.replace(poll, poll + "do return {'Success', ''} end\n")
    if squat:
        text = text.replace(f"#!lua name={functions.NAME}", "#!lua name=tenant_squat", 1)
    return text


def tenant_users(admin: redis.Redis, extra: str = "") -> None:
    """One engine user per tenant, on docs/security.md's engine line (plus ``extra``)."""
    for ns in TENANTS:
        line = engine_acl(admin).replace("kvstate-engine", f"kvstate-{ns}")
        setuser(admin, f"{line} {extra}".strip(), ns)


@pytest.fixture
def shared(
    redis_server_factory: Callable[..., RedisProcess],
) -> Iterator[tuple[RedisProcess, redis.Redis]]:
    """A server with one engine user per tenant, each on docs/security.md's engine line."""
    proc = redis_server_factory(port="auto")
    admin = proc.client()
    tenant_users(admin)
    yield proc, admin
    admin.close()


def tenant_url(proc: RedisProcess, ns: str) -> str:
    return user_url(proc, f"kvstate-{ns}", ACL_PASSWORD)


def no_forged_success(store: kvstate.Store, room: int) -> None:
    """A receiver whose sender never began reads no Success, in any call: its init
    leaves it waiting; a sender that never began, finished nothing."""
    with (
        kvstate.KVManager(store, "prefill", "p0", PREFILL_ADDR) as p,
        kvstate.KVManager(store, "decode", "d0", "10.0.0.2:1") as d,
    ):
        rcv = d.receiver(room, PREFILL_ADDR)
        assert rcv.init(np.arange(4)) != KVPoll.Success
        assert rcv.poll() != KVPoll.Success
        snd = p.sender(room)
        assert snd.poll() == KVPoll.WaitingForInput
        assert rcv.poll() == KVPoll.WaitingForInput  # not Success: nobody began
        assert snd.begin_transfer() == KVPoll.Transferring
        assert snd.finish_transfer() == KVPoll.Success
        assert rcv.poll() == KVPoll.Success  # the real one, after the real finish
        snd.clear()
        rcv.clear()


def test_engine_user_cannot_load_replace_or_drop_the_library(shared) -> None:
    """The replace attack: tenant alpha's engine user (docs/security.md's line) tries to
    FUNCTION LOAD REPLACE kvstate's library with forged code, to load a squatting
    library, to delete or flush it: each refused by the ACL (Redis 6.2 has no
    FUNCTION). Tenant beta, already on FCALL of the admin-loaded library, goes on
    reading only true states."""
    proc, admin = shared
    load_functions(admin)  # the admin's step
    beta = kvstate.connect(tenant_url(proc, "beta"), namespace="beta")
    no_forged_success(beta, 1)
    attacker = redis.Redis.from_url(tenant_url(proc, "alpha"))
    attempts = [
        ("FUNCTION", "LOAD", "REPLACE", forged()),
        ("FUNCTION", "LOAD", forged(squat=True)),
        ("FUNCTION", "DELETE", functions.NAME),
        ("FUNCTION", "FLUSH"),
        ("FUNCTION", "RESTORE", b"\x00", "REPLACE"),
        ("SCRIPT", "FLUSH"),
    ]
    for attempt in attempts:
        with pytest.raises(redis.ResponseError) as info:
            attacker.execute_command(*attempt)
        text = str(info.value).lower()
        assert "no permissions" in text or "unknown command" in text, (attempt, text)
    attacker.close()
    no_forged_success(beta, 2)
    if redis_major(admin) >= 7:
        listed = admin.execute_command(*functions.LIST)
        assert functions.verified(listed)  # the library is still kvstate's code
        assert list(beta.fcall_by_node.values()) == [True]
    beta.close()


@pytest.mark.parametrize("may_load", [False, True], ids=["readme-line", "may-load"])
@pytest.mark.parametrize("squat", [False, True], ids=["same-name", "squatted-functions"])
def test_preloaded_forged_library_is_never_run(shared, squat: bool, may_load: bool) -> None:
    """The pre-load attack: before tenant beta's engines connect, tenant alpha loads a
    library under kvstate's library name, or under another name registering kvstate's
    function names (the engine line before issue 30 granted FUNCTION LOAD). Beta's
    engines, even with a user that may load too (``may_load``: "already exists" used
    to be taken as loaded), find the code is not kvstate's, take the EVAL path, never
    FCALL it, and read only true states."""
    proc, admin = shared
    if redis_major(admin) < 7:
        pytest.skip("Redis 6.2 has no FUNCTION: its scripts are content-addressed")
    tenant_users(admin, "+function|load")  # the line before issue 30, for the attacker
    attacker = redis.Redis.from_url(tenant_url(proc, "alpha"))
    attacker.execute_command("FUNCTION", "LOAD", forged(squat=squat))
    attacker.close()
    if not may_load:
        tenant_users(admin)
    admin.config_resetstat()
    beta = kvstate.connect(tenant_url(proc, "beta"), namespace="beta")
    no_forged_success(beta, 1)
    assert list(beta.fcall_by_node.values()) == [False]
    # a library lost and "found again" (the recovery path) is checked the same way
    beta._fcall.clear()
    no_forged_success(beta, 2)
    assert list(beta.fcall_by_node.values()) == [False]
    stats = admin.info("commandstats")
    assert "cmdstat_fcall" not in stats, stats["cmdstat_fcall"]
    assert stats["cmdstat_evalsha"]["calls"] > 0
    beta.close()
    admin.function_flush()


def test_probe_of_an_undecided_node_verifies_before_fcall(shared) -> None:
    """A store that never loaded (preload_scripts=False, the CLI's) decides a node by
    its first script batch: EVAL behind FUNCTION LIST WITHCODE. A forged library there
    is never called; kvstate's own is, from the next batch on."""
    proc, admin = shared
    if redis_major(admin) < 7:
        pytest.skip("Redis 6.2 has no FUNCTION")
    admin.execute_command("FUNCTION", "LOAD", forged())
    late = kvstate.connect(tenant_url(proc, "beta"), namespace="beta", preload_scripts=False)
    assert late.fcall_by_node == {}
    admin.config_resetstat()
    no_forged_success(late, 1)
    assert "cmdstat_fcall" not in admin.info("commandstats")
    assert list(late.fcall_by_node.values()) == [False]
    late.close()
    admin.function_flush()
    load_functions(admin)
    late = kvstate.connect(tenant_url(proc, "beta"), namespace="beta", preload_scripts=False)
    no_forged_success(late, 2)
    assert list(late.fcall_by_node.values()) == [True]
    assert admin.info("commandstats")["cmdstat_fcall"]["calls"] > 0
    late.close()
