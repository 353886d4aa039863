"""Issue 31 item 7, the small things a new user meets: a password the server ignores
is said, not accepted silently; `Store` is a context manager; `print(KVPoll.Success)`
names it; an abort's reason is one line, not a document; the demo's verdict counts its
own keys, not a shared namespace's; the README names `transfer_infos()`. Real
redis-server; the CLI as a process or through click's runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kvstate
from kvstate.cli import main
from kvstate.errors import ClosedError
from kvstate.poll import KVPoll
from kvstate.testing import RedisProcess
from tests.helpers import DEMO_SMALL, demo_command, demo_env, scaled

ROOT = Path(__file__).resolve().parents[1]
ADDR = "10.0.0.1:8998"


def _cli(url: str, *args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    env["KVSTATE_REDIS_URL"] = url
    if password is not None:
        env["KVSTATE_REDIS_PASSWORD"] = password
    return subprocess.run(
        [sys.executable, "-m", "kvstate.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(60),
    )


def test_a_password_the_server_ignores_is_said(
    redis_url: str, redis_server_factory: Callable[..., RedisProcess]
) -> None:
    """redis-cli says "AUTH failed: ... called without any password configured"; kvstate
    took the password silently, so a server believed protected was open."""
    wrong = redis_url.replace("unix://", "unix://:not-the-password@")
    result = _cli(wrong, "ls")
    assert result.returncode == 1, result.stderr  # the empty namespace: the command ran
    assert "kvstate: warning: " in result.stderr
    assert "has no password for its default user" in result.stderr
    assert "not-the-password" not in result.stderr + result.stdout  # design rule 8
    env_pw = _cli(redis_url, "ls", password="from-the-env")
    assert "has no password for its default user" in env_pw.stderr
    # a server that asks for it: nothing to say
    guarded = redis_server_factory(password="right-one")
    ok = _cli(guarded.unix_url, "ls")
    assert ok.returncode == 1 and "warning" not in ok.stderr, ok.stderr
    store = kvstate.connect(wrong)
    assert store.password_ignored
    store.close()


def test_store_is_a_context_manager_and_kvpoll_prints_its_name(redis_url: str) -> None:
    with kvstate.connect(redis_url) as store:
        assert store.server_time_ms() > 0
    assert store.closed
    with pytest.raises(ClosedError):
        store.server_time_ms()
    assert str(KVPoll.Success) == "KVPoll.Success" and f"{KVPoll.Failed}" == "KVPoll.Failed"
    assert f"{KVPoll.Success:d}" == "4" and KVPoll.Success == 4 and int(KVPoll.Success) == 4
    done = subprocess.run(
        [sys.executable, "-c", "import kvstate; print(kvstate.KVPoll.Success)"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert done.stdout.strip() == "KVPoll.Success"  # it printed 4


def test_a_long_abort_reason_is_refused_before_anything_is_written(redis_url: str) -> None:
    """A 120 KB --reason was stored in every participant and echoed whole."""
    with (
        kvstate.connect(redis_url) as store,
        kvstate.KVManager(store, "prefill", "prefill-a", ADDR) as p,
    ):
        snd = p.sender(5)
        assert snd.poll() == KVPoll.Bootstrapping
        result = CliRunner().invoke(
            main, ["--url", redis_url, "abort", "5", "--reason", "x" * 120_000]
        )
        assert result.exit_code == 2, result.output
        assert "--reason" in result.output and "120000 characters" in result.output
        assert len(result.output) < 1000
        assert snd.poll() == KVPoll.Bootstrapping  # nothing written
        assert store.client.exists(store.keys.aborted(5)) == 0
        ok = CliRunner().invoke(main, ["--url", redis_url, "abort", "5", "--reason", "y" * 1000])
        assert ok.exit_code == 0, ok.output


def test_demo_verdict_counts_its_own_keys_in_a_shared_namespace(redis_url: str) -> None:
    """A demo given --url and a namespace other engines use counted their keys as its
    own leaks ("keys left"), and failed."""
    with (
        kvstate.connect(redis_url, namespace="shared") as store,
        kvstate.KVManager(store, "prefill", "someone-else", "10.9.9.9:1") as other,
    ):
        snd = other.sender(123456)
        assert snd.poll() == KVPoll.Bootstrapping  # a live room of another engine
        proc = subprocess.run(
            [*demo_command(), "--url", redis_url, "--namespace", "shared"]
            + ["--requests", "3", "--json", *DEMO_SMALL],
            capture_output=True,
            text=True,
            env=demo_env(),
            timeout=scaled(180),
        )
        assert proc.returncode == 0, proc.stderr + proc.stdout
        doc = json.loads(proc.stdout)
        assert doc["ok"] is True and doc["keys_left"] == 0, doc
        assert doc["other_keys"] >= 3, doc  # its engine, room hash, participant...
        assert doc["audit"]["result"] == "clean", doc["audit"]
        assert store.client.exists(snd.key) == 1  # and the demo left them alone
        snd.abort("test over")
        snd.clear()


def test_readme_names_transfer_infos(redis_url: str) -> None:
    """A bring-your-own-transport sender reads where to write from transfer_infos()."""
    readme = (ROOT / "README.md").read_text()
    assert "snd.transfer_infos()" in readme
    with (
        kvstate.connect(redis_url) as store,
        kvstate.KVManager(store, "prefill", "p", ADDR) as p,
        kvstate.KVManager(store, "decode", "d") as d,
    ):
        snd, rcv = p.sender(9), d.receiver(9, ADDR)
        rcv.init(np.arange(3, 7), prefix_len=2)
        assert snd.poll() == KVPoll.WaitingForInput
        (info,) = snd.transfer_infos().values()
        assert list(info.kv_indices) == [3, 4, 5, 6] and info.prefix_len == 2
