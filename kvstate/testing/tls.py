"""Throwaway TLS certificates for test servers, and whether a redis-server speaks TLS."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstate.errors import RedisServerError

__all__ = ["TLSFiles", "make_test_certs", "supports_tls"]


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
