"""docker-compose.yml, checked without Docker: the Redis settings kvstate relies on, the
cluster profile, the worker wiring, and that every ``kvstate ...`` command it runs
exists in the CLI with those options."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import scaled, wait_for

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
        assert env["KVSTATE_REDIS_URL"] == "${KVSTATE_REDIS_URL:-redis://redis:6379}", name
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
            assert _required(env["KVSTATE_REDIS_PASSWORD"], "KVSTATE_REDIS_PASSWORD"), name
            # never pasted into a URL: a character such as @ / : in it would break it
            assert "@" not in env["KVSTATE_REDIS_URL"], name
            assert "PASSWORD" not in env["KVSTATE_REDIS_URL"], name
        cmd = " ".join(argv(svc))
        if "redis-server" in cmd:
            assert _required(env["REDIS_PASSWORD"], "KVSTATE_REDIS_PASSWORD"), name
            assert _required(env["REDISCLI_AUTH"], "KVSTATE_REDIS_PASSWORD"), name
            assert "requirepass" in cmd and "--requirepass" not in cmd, name  # not in argv


@contextmanager
def compose_redis(tmp_path: Path, password: str) -> Iterator[int]:
    """The redis service's own command, run with the real redis-server on a free port
    (its config file in a temp folder); yields the port once it answers."""
    import redis

    from kvstate.testing import find_redis_server, free_port

    cmd = argv(yaml.safe_load(COMPOSE.read_text())["services"]["redis"])
    assert cmd[:2] == ["sh", "-c"]
    script = cmd[2].replace("/tmp/redis-auth.conf", str(tmp_path / "auth.conf"))
    script = script.replace("exec redis-server", f"exec {find_redis_server()}")
    port = free_port()
    script += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={"REDIS_PASSWORD": password, "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
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
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        yield port
    finally:
        proc.terminate()
        proc.wait(scaled(10))


def test_redis_command_requires_the_password(tmp_path: Path) -> None:
    """Without the password every command is refused."""
    import redis

    password = "pw-" + tmp_path.name
    with compose_redis(tmp_path, password) as port:
        with (
            redis.Redis(port=port, socket_timeout=2) as c,
            pytest.raises(redis.AuthenticationError),
        ):
            c.ping()
        with redis.Redis(port=port, password=password, socket_timeout=2) as c:
            assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"


def _health(service: dict[str, Any]) -> list[str]:
    """A healthcheck's command as Docker runs it: CMD-SHELL through sh -c, CMD as is."""
    test = [str(t).replace("$$", "$") for t in service["healthcheck"]["test"]]
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", test[1]]
    assert test[0] == "CMD", test
    return test[1:]


def test_redis_healthcheck_fails_on_noauth(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """`redis-cli ping` exits 0 on a NOAUTH reply: the old check passed with a wrong or
    missing password. The check must fail then, and pass with the right one."""
    password = "pw-" + tmp_path.name
    with compose_redis(tmp_path, password) as port:
        for name in ("redis", "redis-cluster-1"):
            check = _health(services[name])
            assert "redis-cli" in " ".join(check), name
            for auth, healthy in ((password, True), ("wrong-password", False), (None, False)):
                env = {"PATH": "/usr/bin:/bin", "PORT": str(port)}
                if auth is not None:
                    env["REDISCLI_AUTH"] = auth
                got = subprocess.run(check, env=env, capture_output=True, timeout=scaled(20))
                assert (got.returncode == 0) == healthy, (name, auth, got)
        old = subprocess.run(
            ["redis-cli", "-p", str(port), "ping"],
            capture_output=True,
            text=True,
            timeout=scaled(20),
        )
        assert old.returncode == 0 and "NOAUTH" in old.stdout  # why status alone is no check


def test_router_and_monitor_healthchecks_work(
    services: dict[str, dict[str, Any]], redis_server_factory: Any, tmp_path: Path
) -> None:
    """The router's check passes once its queue port listens; the monitor's only while
    its metrics say kvstate_up 1 (a monitor that cannot read Redis is not healthy)."""
    from kvstate.testing import free_port

    router = _health(services["router"])
    port = free_port()
    check = [a.replace("7070", str(port)) for a in router]
    assert subprocess.run(check, capture_output=True, timeout=scaled(20)).returncode != 0
    with socket.create_server(("127.0.0.1", port)):
        assert subprocess.run(check, capture_output=True, timeout=scaled(20)).returncode == 0

    monitor = _health(services["monitor"])
    server = redis_server_factory(port="auto")
    metrics = free_port()
    check = [a.replace("9108", str(metrics)) for a in monitor]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstate.cli", "--url", server.tcp_url, "monitor"]
        + ["--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1", "--interval", "200ms"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )

    def healthy() -> bool:
        return subprocess.run(check, capture_output=True, timeout=scaled(20)).returncode == 0

    try:
        assert wait_for(healthy, 60)
        server.kill()
        assert wait_for(lambda: not healthy(), 60)
        server.restart()
        assert wait_for(healthy, 60)
    finally:
        proc.terminate()
        proc.wait(scaled(30))


def test_restart_policies(services: dict[str, dict[str, Any]]) -> None:
    """Redis and the monitor come back unless stopped; the run (router, workers) and the
    one-shot cluster init say explicitly that they do not."""
    for name, svc in services.items():
        assert "restart" in svc, f"{name} has no restart policy"
        serving = name.startswith("redis-cluster-") and name != "redis-cluster-init"
        if name in ("redis", "monitor", "prometheus", "grafana") or serving:
            assert svc["restart"] == "unless-stopped", name
        else:
            assert svc["restart"] == "no", name
    for name in ("redis", "router", "monitor"):
        assert services[name].get("healthcheck"), f"{name} has no healthcheck"
    for name, svc in services.items():  # workers start once the router takes them
        if "--worker" in argv(svc):
            assert svc["depends_on"]["router"]["condition"] == "service_healthy", name


def _header() -> list[str]:
    lines = []
    for line in COMPOSE.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return lines


def _host_commands() -> list[str]:
    """The header's block of commands to run from the host."""
    lines = _header()
    start = next(i for i, line in enumerate(lines) if "tests/test_compose.py runs" in line)
    block = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        block.append(line.strip())
    return block


def test_header_commands_work_as_written(tmp_path: Path) -> None:
    """The header's own lines: its printf writes .env; its host block reads the password
    from there (the old one exported a URL built from a variable that lived only in
    .env) and reaches the compose Redis (here on a free port instead of 6379)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH (the header makes the secrets with it)")
    (printf,) = [line.strip() for line in _header() if line.strip().startswith("printf ")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTATE_")}
    subprocess.run(["bash", "-c", printf], cwd=tmp_path, env=env, check=True, timeout=scaled(30))
    dotenv = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().split())
    assert len(dotenv["KVSTATE_REDIS_PASSWORD"]) == 32 and len(dotenv["KVSTATE_DEMO_AUTHKEY"]) == 32
    block = _host_commands()
    assert block[0].startswith("set -a; . ./.env; set +a")
    assert any(line.startswith("kvstate top") for line in block)
    (tmp_path / "redis-data").mkdir()
    with compose_redis(tmp_path / "redis-data", dotenv["KVSTATE_REDIS_PASSWORD"]) as port:
        script = "set -e\n" + "\n".join(
            line.replace(":6379", f":{port}")
            for line in block
            if not line.startswith("kvstate top")
        )
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        got = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
    assert got.returncode == 0, got.stdout + got.stderr
    assert "redis" in got.stdout and dotenv["KVSTATE_REDIS_PASSWORD"] not in got.stdout + got.stderr


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not installed")
def test_docker_compose_accepts_the_file() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


ROOT = COMPOSE.parent


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: container path -> the file or folder in this repo."""
    out = {}
    for v in svc.get("volumes", []):
        host, container = str(v).split(":")[:2]
        out[container] = (ROOT / host).resolve()
    return out


def test_observability_profile_provisions_prometheus_and_grafana(
    services: dict[str, dict[str, Any]],
) -> None:
    """Issue 31: a compose profile with Prometheus (scraping the monitor, evaluating the
    alert rules) and Grafana (that Prometheus as data source, the shipped dashboard
    provisioned), every file it mounts in the repo and consistent with the others."""
    prom, graf = services["prometheus"], services["grafana"]
    assert prom["profiles"] == graf["profiles"] == ["observability"]
    mounts = _mounts(prom)
    for path in mounts.values():
        assert path.is_file(), path
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    targets = [
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    port = option(argv(services["monitor"]), "--metrics-port")
    assert targets == [f"monitor:{port}"]
    for rule_file in config["rule_files"]:  # where Prometheus reads them, mounted
        assert f"/etc/prometheus/{rule_file}" in mounts
        assert mounts[f"/etc/prometheus/{rule_file}"].name == "kvstate-alerts.yml"
    graf_mounts = _mounts(graf)
    provisioning = graf_mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    prom_port = str(prom["ports"][0]).rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prom_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvstate.yml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    dashboards = {c: p for c, p in graf_mounts.items() if c.startswith(folder + "/")}
    assert [p.relative_to(ROOT).as_posix() for p in dashboards.values()] == [
        "docs/grafana/kvstate.json"
    ]
    password = graf["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert _required(password, "KVSTATE_GRAFANA_PASSWORD")
    assert "KVSTATE_GRAFANA_PASSWORD" in COMPOSE.read_text().split("services:")[0]  # .env line
    promtool = shutil.which("promtool")
    if promtool is not None:  # .ci/run installs it where it can
        done = subprocess.run(
            [promtool, "check", "config", config_path.name],
            cwd=config_path.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
