"""docker-compose.yml, checked without Docker: the Redis settings kvstate relies on, the
cluster profile, the worker wiring, and that every ``kvstate ...`` command it runs
exists in the CLI with those options."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import scaled

yaml = pytest.importorskip("yaml")

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved by PyYAML
    return doc["services"]


def argv(service: dict[str, Any]) -> list[str]:
    """The command as compose runs it: a string is split like a shell would, and
    ``$$`` is compose's escape for a literal ``$``."""
    cmd = service.get("command") or []
    if isinstance(cmd, str):
        return shlex.split(cmd.replace("$$", "$"))
    return [str(a).replace("$$", "$") for a in cmd]


def kvstate_commands(services: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    return {name: argv(s)[1:] for name, s in services.items() if argv(s)[:1] == ["kvstate"]}


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_redis_keeps_state_and_reports_expiry(services: dict[str, dict[str, Any]]) -> None:
    servers = [
        n
        for n, s in services.items()
        if argv(s)[:1] == ["redis-server"] or "redis-server" in " ".join(argv(s))
    ]
    assert "redis" in servers and len(servers) == 4
    for name in servers:
        cmd = " ".join(argv(services[name]))
        assert "--maxmemory-policy noeviction" in cmd, name
        assert "--notify-keyspace-events Ex" in cmd, name


def test_cluster_profile_has_three_primaries(services: dict[str, dict[str, Any]]) -> None:
    nodes = [
        n
        for n, s in services.items()
        if "cluster" in s.get("profiles", []) and "--cluster-enabled yes" in " ".join(argv(s))
    ]
    assert len(nodes) == 3
    init = " ".join(argv(services["redis-cluster-init"]))
    assert "--cluster create" in init and "--cluster-replicas 0" in init
    for i, name in enumerate(sorted(nodes), start=1):
        assert f"{name}:700{i}" in init or f"hosts {name} " in init
    assert services["redis-cluster-init"]["profiles"] == ["cluster"]
    assert "cluster" not in services["redis"].get("profiles", [])


def test_workers_attach_to_the_router(services: dict[str, dict[str, Any]]) -> None:
    cmds = kvstate_commands(services)
    router = cmds["router"]
    assert router[0] == "demo" and "--listen" in router
    port = option(router, "--listen").rpartition(":")[2]
    for role in ("prefill", "decode"):
        want = int(option(router, f"--{role}-workers"))
        engines = []
        for name, args in cmds.items():
            if args[:1] == ["demo"] and "--worker" in args and option(args, "--worker") == role:
                engines.append(option(args, "--engine"))
                assert option(args, "--router") == f"router:{port}", name
        # the router waits for exactly <role>-0 .. <role>-(n-1)
        assert sorted(engines) == [f"{role}-{i}" for i in range(want)]
    for name in cmds:
        env = services[name]["environment"]
        assert env["KVSTATE_REDIS_URL"].endswith("@redis:6379}"), name
        assert env["KVSTATE_NAMESPACE"] == "demo"


def test_monitor_exports_its_metrics_port(services: dict[str, dict[str, Any]]) -> None:
    args = kvstate_commands(services)["monitor"]
    assert args[0] == "monitor"
    port = option(args, "--metrics-port")
    assert any(str(p).endswith(f":{port}") for p in services["monitor"]["ports"])


def test_every_kvstate_command_exists_in_the_cli(services: dict[str, dict[str, Any]]) -> None:
    try:
        import click

        from kvstate.cli import main
    except ImportError as exc:
        pytest.skip(f"kvstate.cli is not importable ({exc}); cannot check commands")
    cmds = kvstate_commands(services)
    assert len(cmds) >= 6
    for name, args in cmds.items():
        # Parse exactly as the console script would, without running anything: an
        # unknown command, option or choice raises a UsageError here.
        ctx = main.make_context("kvstate", list(args))
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        sub_name, sub, sub_args = main.resolve_command(ctx, rest)
        assert sub is not None and sub_name, name
        try:
            sub.make_context(sub_name, list(sub_args), parent=ctx)
        except click.UsageError as exc:
            pytest.fail(f"service {name}: `kvstate {' '.join(args)}`: {exc}")


def test_nothing_is_published_on_public_interfaces(services: dict[str, dict[str, Any]]) -> None:
    """A published port binds 127.0.0.1 only (Docker's default is 0.0.0.0); the router's
    queue port is not published at all."""
    published = {name: s.get("ports", []) for name, s in services.items() if s.get("ports")}
    assert published, "expected Redis and the metrics port on the host's loopback"
    for name, ports in published.items():
        for p in ports:
            assert str(p).startswith("127.0.0.1:"), f"{name} publishes {p}"
    assert "ports" not in services["router"]


def _required(value: str, var: str) -> bool:
    """``${VAR:?message}``: compose refuses to start while VAR is unset or empty."""
    return value.startswith(f"${{{var}:?")


def test_secrets_come_from_the_user(services: dict[str, dict[str, Any]]) -> None:
    """No committed secret and no default one: Redis requires a password and the queues
    a key, both from the user's environment / .env, and refused when unset."""
    text = COMPOSE.read_text()
    assert "kvstate-demo}" not in text and ":-kvstate" not in text  # the old public key
    assert not re.search(r"(PASSWORD|AUTHKEY|AUTH):?-", text), "a secret with a default"
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if argv(svc)[:1] == ["kvstate"]:
            assert _required(env["KVSTATE_DEMO_AUTHKEY"], "KVSTATE_DEMO_AUTHKEY"), name
            assert "${KVSTATE_REDIS_PASSWORD:?" in env["KVSTATE_REDIS_URL"], name
        cmd = " ".join(argv(svc))
        if "redis-server" in cmd:
            assert _required(env["REDIS_PASSWORD"], "KVSTATE_REDIS_PASSWORD"), name
            assert _required(env["REDISCLI_AUTH"], "KVSTATE_REDIS_PASSWORD"), name
            assert "requirepass" in cmd and "--requirepass" not in cmd, name  # not in argv


def test_redis_command_requires_the_password(tmp_path: Path) -> None:
    """Run the redis service's own command with the real redis-server (on a free port
    and a temp file): without the password every command is refused."""
    from kvstate.testing import find_redis_server, free_port

    doc = yaml.safe_load(COMPOSE.read_text())
    cmd = argv(doc["services"]["redis"])
    assert cmd[:2] == ["sh", "-c"]
    conf = tmp_path / "auth.conf"
    script = cmd[2].replace("/tmp/redis-auth.conf", str(conf))
    script = script.replace("exec redis-server", f"exec {find_redis_server()}")
    port = free_port()
    script += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    password = "pw-" + tmp_path.name
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={"REDIS_PASSWORD": password, "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        deadline = time.monotonic() + scaled(20)
        while True:
            try:
                with redis.Redis(port=port, password=password, socket_timeout=2) as c:
                    assert c.ping()
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        with (
            redis.Redis(port=port, socket_timeout=2) as c,
            pytest.raises(redis.AuthenticationError),
        ):
            c.ping()
        with redis.Redis(port=port, password=password, socket_timeout=2) as c:
            assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not installed")
def test_docker_compose_accepts_the_file() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
