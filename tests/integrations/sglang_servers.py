"""Real SGLang 0.5.23 servers for the end-to-end tests: ``sglang.launch_server`` processes
(plain, prefill, decode with ``--disaggregation-transfer-backend kvstate``) and SGLang's
router (``sglang_router.launch_router --pd-disaggregation --mini-lb``), on free ports.

The same code serves a GPU host and a CPU host. Without a GPU the servers run SGLang's
CPU engine (``SGLANG_USE_CPU_ENGINE=1``) with the flags it needs there (torch_native
attention, no CUDA graphs, no overlap scheduling, decode's retraction backup off: it
calls cudaHostRegister),
and, when no ``sgl_kernel`` is installed, the torch stand-ins in ``sglang_cpu/`` for the
two ops of sgl-kernel's CPU build (not on PyPI). With a GPU none of that applies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.helpers import scaled

CPU_OPS = Path(__file__).parent / "sglang_cpu"
PAGE = 16  # --page-size
CHUNK = 64  # --chunked-prefill-size
START_TIMEOUT = 300.0  # one server's start, before the time factor


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port not handed out before in this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def server_env(redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KVSTATE_REDIS_URL=redis_url,
        KVSTATE_SGLANG_LEASE="2",  # a killed peer's rooms fail within seconds
        PYTHONUNBUFFERED="1",
    )
    if not has_gpu():
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if importlib.util.find_spec("sgl_kernel") is None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_OPS), env.get("PYTHONPATH", "")) if p
            )
    return env


def server_flags(model: Path, port: int) -> list[str]:
    flags = [
        "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK),
        "--max-total-tokens", "4096", "--dtype", "float32", "--skip-server-warmup",
        "--enable-metrics", "--decode-log-interval", "1", "--disable-radix-cache",
    ]  # fmt: skip
    if not has_gpu():
        flags += [
            "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--mem-fraction-static", "0.05",
            # overlap scheduling makes prefill's early send of a chunked prompt record a
            # CUDA event (torch.cuda.Event) on the CPU engine's stream: a crash on CPU
            "--disable-overlap-schedule",
        ]  # fmt: skip
    else:
        flags += ["--mem-fraction-static", "0.1"]
    return flags


class PortTaken(RuntimeError):
    pass


@dataclass
class Proc:
    """One server process, its log, and how to reach it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str
    health: str = "/health"
    popen: subprocess.Popen[bytes] | None = None
    started: list[float] = field(default_factory=list)  # seconds each start took

    def start(self) -> None:
        """Start and wait for health; a port taken meanwhile (SGLang picks internal
        ports of its own too) means new ports and another try."""
        for _ in range(3 if not self.started else 0):  # a restart keeps its ports
            try:
                return self._start()
            except PortTaken:
                for flag in ("--port", "--disaggregation-bootstrap-port"):
                    if flag in self.argv:
                        self.argv[self.argv.index(flag) + 1] = str(free_port())
                self.url = f"http://127.0.0.1:{self.argv[self.argv.index('--port') + 1]}"
        self._start()

    def _start(self) -> None:
        t0 = time.monotonic()
        out = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        deadline = t0 + scaled(START_TIMEOUT)
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                if "address already in use" in self.tail():
                    raise PortTaken(self.name)
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + self.health, timeout=5).status_code == 200:
                    self.started.append(time.monotonic() - t0)
                    return
            time.sleep(1)
        self.stop()
        raise RuntimeError(
            f"{self.name} not healthy in {scaled(START_TIMEOUT):.0f}s:\n{self.tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the server and every process it started (scheduler, detokenizer)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(30)
        elif self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)

    def stop(self) -> None:
        """At the end of the tests (a server's SIGTERM shutdown can hang on CPU)."""
        self.kill()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def launch(name: str, model: Path, logdir: Path, redis_url: str, *extra: str) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", *server_flags(model, port), *extra]
    return Proc(
        name, argv, server_env(redis_url), logdir / f"{name}.log", f"http://127.0.0.1:{port}"
    )


def prefill(model: Path, logdir: Path, redis_url: str, *more: str) -> tuple[Proc, int]:
    bootstrap = free_port()
    p = launch(
        "prefill", model, logdir, redis_url,
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvstate",
        "--disaggregation-bootstrap-port", str(bootstrap), *more,
    )  # fmt: skip
    return p, bootstrap


def decode(model: Path, logdir: Path, redis_url: str, *more: str) -> Proc:
    extra = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvstate"]
    if not has_gpu():
        extra += ["--disaggregation-decode-retraction-backup", "none"]
    return launch("decode", model, logdir, redis_url, *extra, *more)


def router(p: Proc, bootstrap: int, d: Proc, logdir: Path) -> Proc:
    port = free_port()
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--mini-lb", "--host", "127.0.0.1", "--port", str(port),
        "--prefill", p.url, str(bootstrap), "--decode", d.url,
    ]  # fmt: skip
    return Proc("router", argv, dict(os.environ), logdir / "router.log", f"http://127.0.0.1:{port}")


def generate(url: str, text: str, max_new: int, timeout: float = 120.0) -> list[int]:
    """Greedy output ids of one request (raises on an HTTP error)."""
    r = requests.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        },
        timeout=scaled(timeout),
    )
    r.raise_for_status()
    ids: list[int] = r.json()["output_ids"]
    return ids


def stream(url: str, text: str, max_new: int, timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed request; closing the iterator drops the connection."""
    with requests.post(
        url + "/generate",
        json={
            "text": text,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        },
        stream=True,
        timeout=scaled(timeout),
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


def metric(url: str, name: str) -> float | None:
    """One gauge from the server's /metrics (summed over its label sets); None until
    the server has published it."""
    text = requests.get(url + "/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"sglang:{name}{{", f"sglang:{name} "))
    ]
    return sum(values) if values else None


def audit(redis_url: str) -> subprocess.CompletedProcess[str]:
    """``kvstate audit`` as an operator runs it (exit 0: clean)."""
    return subprocess.run(
        [sys.executable, "-m", "kvstate.cli", "audit"],
        env={**os.environ, "KVSTATE_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


@dataclass
class Deployment:
    """A plain server and a prefill/decode pair behind the router, one Redis."""

    redis_url: str
    logdir: Path
    models: dict[str, Path]
    plain: Proc
    prefill: Proc
    bootstrap: int
    decode: Proc
    router: Proc

    def procs(self) -> list[Proc]:
        return [self.router, self.prefill, self.decode, self.plain]

    def keys(self) -> list[str]:
        import redis

        with redis.Redis.from_url(self.redis_url) as c:
            return sorted(k.decode() for k in c.scan_iter("*"))

    def room_keys(self) -> list[str]:
        """Everything but the engines' own registrations and rooms' failure marks and
        traces, which outlive clear() on purpose (docs/design.md): each must have its TTL."""
        import redis

        keys = [k for k in self.keys() if ":engine:" not in k and ":engines_at:" not in k]
        kept = [k for k in keys if k.endswith(("}:aborted", "}:trace"))]
        with redis.Redis.from_url(self.redis_url) as c:
            assert all(c.pttl(k) > 0 for k in kept), kept
        return [k for k in keys if k not in kept]

    def logs(self) -> str:
        return "\n".join(p.log.read_text(errors="replace") for p in self.procs() if p.log.exists())


def deploy(tmp: Path, redis_url: str, decode_flags: Sequence[str] = ()) -> Deployment:
    """Build the two models, start the servers (three at once) and the router;
    ``decode_flags``: more of the decode server's flags (tools/bench_sglang_e2e.py)."""
    import concurrent.futures

    from tests.integrations.sglang_model import build

    models = {"a": build(tmp / "model-a", seed=1), "b": build(tmp / "model-b", seed=2)}
    logdir = tmp / "logs"
    logdir.mkdir()
    plain = launch("plain", models["a"], logdir, redis_url)
    p, bootstrap = prefill(models["a"], logdir, redis_url)
    d = decode(models["a"], logdir, redis_url, *decode_flags)
    started: list[Proc] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = {pool.submit(s.start): s for s in (plain, p, d)}
            for f in concurrent.futures.as_completed(futures):
                started.append(futures[f])
                f.result()
        bootstrap = int(p.argv[p.argv.index("--disaggregation-bootstrap-port") + 1])
        r = router(p, bootstrap, d, logdir)
        started.append(r)
        r.start()
    except BaseException:
        for s in started:
            s.stop()
        raise
    return Deployment(redis_url, logdir, models, plain, p, bootstrap, d, r)
