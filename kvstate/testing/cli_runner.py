"""Run the real ``redis-cli`` against a kvstate URL (tests and tools compare with it)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from urllib.parse import parse_qs, unquote, urlsplit

from kvstate.errors import RedisServerError
from kvstate.testing.process import find_redis_cli

__all__ = ["run_redis_cli"]

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
    env = dict(os.environ)
    env.pop("REDISCLI_AUTH", None)
    if parts.password:
        env["REDISCLI_AUTH"] = unquote(parts.password)
    cmd = [cli or find_redis_cli(), *_connection_args(url), *extra_cli_args]
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


def _connection_args(url: str) -> list[str]:
    """redis-cli options that reach ``url``'s server and database (the password aside)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    cmd = ["--user", unquote(parts.username)] if parts.username else []
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
        db = parts.path.strip("/") or query.get("db")
    else:
        raise ValueError(f"run_redis_cli: unsupported URL scheme {scheme!r}")
    if db and db != "0":
        cmd += ["-n", db]
    return cmd
