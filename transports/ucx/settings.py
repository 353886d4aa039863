"""UCX settings: kvstate's defaults for UCX, and the knobs the environment overrides.

Settings (each can be overridden)
    * UCX endpoints are made from worker addresses WITH error handling
      (``KVSTATE_UCX_ERROR_HANDLING=0`` turns it off: faster on one host, but a
      dead peer then aborts this process; for trusted benchmarks only). Every
      wait still has a deadline: a vanished host sends no reset.
    * ``KVSTATE_UCX_CMA=0`` sends same-host transfers through UCX puts too.
    * Progress mode ``blocking`` (``KVSTATE_UCX_PROGRESS_MODE``; ``polling``
      is accepted). ``thread`` is refused: its progress thread would race the
      ctypes calls, which must run on the thread that progresses the worker.
      Blocking beat thread by 1.5-2x on 2 cores; polling spins a core. In
      blocking mode the transport re-arms the worker after progress itself
      (ucxx 0.52 does not, and its loop then spins a core while idle).
    * ``UCX_DEFAULTS`` are exported unless the environment sets them (the
      environment wins; ``ucx_env()`` says what is in effect):
      ``UCX_TCP_TX_SEG_SIZE=256K`` and ``UCX_TCP_RX_SEG_SIZE=512K`` (UCX: 8K
      and 64K). With error handling on and ucxx's rendezvous threshold (8192,
      before ``KVSTATE_UCX_RNDV_THRESH`` below), UCX had no zero-copy put over
      TCP and emulated each put with active messages of at most one TX segment
      (``UCX_PROTO_INFO=y`` shows it), so 8K segments meant 2048 messages per
      16 MiB put; the measurements here are from then. Measured between two
      network namespaces over a veth pair, settings timed in turn
      (``tools/bench_transfer.py --cross-host``;
      docs/benchmarks.md has the figures): fragmented pages 1.4-1.5 -> 3.6 GB/s,
      contiguous unchanged (1.5-1.6); 1M/2M: contiguous 1.9-2.1, fragmented
      3.1-3.3, at 4-6x the memory below.
      Cost: the segments come from UCX memory pools that grow per connection
      in use: +0.3 MiB resident per process for one peer moving 64 MiB, +1.0
      MiB on a sender writing to 4 receivers (+0.4 MiB on each receiver),
      against UCX's defaults. TX must not exceed RX (UCX refuses it; checked
      here with a clear error). RDMA, cuda_ipc and shared memory ignore them.
    * ``KVSTATE_UCX_RNDV_THRESH`` (default: unset, ucxx's 8192): UCX's
      ``RNDV_THRESH`` for kvstate's UCX context, passed to ``ucxx.init`` as an
      option when set (it wins over ``UCX_RNDV_THRESH``, which ucxx exports as 8192
      on import whenever the environment lacks it, so that variable cannot tell a
      user's choice from ucxx's). With error handling on and a finite threshold,
      UCX 1.21 builds a same-host endpoint on tcp/lo alone and emulates every put of
      host memory by active messages over loopback TCP (``UCX_PROTO_INFO=y``:
      "software emulation via tcp/lo"); with ``inf`` the endpoint keeps a cma lane
      and puts go zero-copy over it ("zero-copy via cma/memory"), as NIXL's own UCX
      build does with error handling on. Measured on one host,
      ``KVSTATE_UCX_CMA=0``, 64 MiB, timed in turn (``tools/bench_transfer.py
      --ucx-lanes``, load 4.9, 2 CPUs): contiguous 1.15 -> 4.61 GB/s, fragmented
      1.12 -> 2.30 (NIXL 1.5.1's best 4.15 / 1.94). Not the default: its lanes on
      device memory are not measured, and one loaded CI run saw a write over TCP to a
      receiver stopped by SIGSTOP complete (not seen since in 200 loaded runs;
      ``tests/test_transport.py::test_stalled_receiver`` now checks that such a write
      is never reported complete without every byte in the stopped receiver's
      memory). Set it for one-host deployments whose same-host path is UCX
      (docs/benchmarks.md, Same host, UCX path).
    * ``UCX_TLS``, ``UCX_RNDV_SCHEME`` and the rest are left to UCX unless set
      in the environment (puts do not use rendezvous; UCX picks RDMA,
      cuda_ipc or TCP as available). ``UCX_WARN_UNUSED_ENV_VARS=n`` is a
      default because ucxx sets a variable UCX 1.21 no longer knows.
    * ``KVSTATE_UCX_PUT_CHUNK`` (default ``64K``; ``0`` for none): the UCX
      path puts host memory in pieces of at most this size (a 16 MiB run
      becomes 256 puts, posted together before the wait). Over TCP each put is
      emulated with active messages that the sender copies out and the
      receiver copies in; smaller puts let those copies overlap on the two
      sides instead of one 16 MiB message at a time. Measured between two
      network namespaces, 64K and whole runs timed in turn in eight runs
      (``tools/bench_transfer.py --cross-host --extra
      c0:KVSTATE_UCX_PUT_CHUNK=0``, load 0.9-3.7 on 2 CPUs): contiguous pages
      0.81-1.43x (median 1.23), fragmented pages (runs of 16-128 KiB)
      0.79-1.06x (median 1.04); 32K and 128K were not better. GPU memory is
      not cut (cuda_ipc and RDMA move big puts best), nor host memory to a peer on
      this host and network namespace, which UCX puts over cma (zero-copy): whole
      runs there against 64K, timed in turn (``KVSTATE_UCX_CMA=0``, load 2.4):
      contiguous 4.66 -> 7.09 GB/s, fragmented 4.17 -> 4.91.
    * ``KVSTATE_CMA_THREADS`` (default 2; 1 on a 1-CPU host): a same-host
      write of at least 8 MiB is split by bytes into that many parts, each a
      series of ``process_vm_writev`` calls on its own thread (the calling
      thread takes one; ``transports.cma.write_runs``). One thread copied at
      5.3-5.7 GB/s here, about 0.4x an in-process memcpy measured alone (the
      kernel pins and maps every 4 KiB page); two at 5.3-9.4 GB/s, 0.75-1.46x
      a memcpy timed in turn with them (``tools/bench_transfer.py``, six
      runs, load 1.1-4.5; docs/benchmarks.md has them). ``1`` keeps every copy on the
      calling thread.
    * ``KVSTATE_CMA_PTRACER``: ``off`` (default), ``any`` or one sender pid;
      see ``transports.cma``. Applied at ``register_buffers`` and logged once.

"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transports import cma
from transports.base import TransportError


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "y", "yes", "true", "on")


#: UCX variables set for this process unless its environment already sets them
#: (the environment wins). Why each, with measurements: this module's docstring.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "512K",
}

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
}


def _size(raw: str) -> int | None:
    """A UCX memory size ("256K", "1m", "65536") in bytes; None if not one."""
    text = raw.strip().upper()
    digits = text.rstrip("BKMG")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        return None
    return int(digits) * _SIZE_UNITS[unit]


#: default for ``KVSTATE_UCX_PUT_CHUNK`` (bytes)
PUT_CHUNK_DEFAULT = 64 << 10


def _put_chunk() -> int:
    raw = os.environ.get("KVSTATE_UCX_PUT_CHUNK", "")
    if raw.strip() == "":
        return PUT_CHUNK_DEFAULT
    value = _size(raw)
    if value is None:
        raise TransportError(
            f"KVSTATE_UCX_PUT_CHUNK={raw!r} is not a size: use bytes or K/M (e.g. 64K), "
            "or 0 for no limit"
        )
    return value


def _cma_threads() -> int:
    raw = os.environ.get("KVSTATE_CMA_THREADS", "").strip()
    if raw == "":
        return max(1, min(2, os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise TransportError(f"KVSTATE_CMA_THREADS={raw!r} is not a whole number >= 1")
    return int(raw)


@dataclass(frozen=True)
class UCXSettings:
    """UCX knobs; defaults come from the environment (see this module's docstring)."""

    progress_mode: str = field(
        default_factory=lambda: os.environ.get("KVSTATE_UCX_PROGRESS_MODE", "blocking")
    )
    error_handling: bool = field(
        default_factory=lambda: _env_flag("KVSTATE_UCX_ERROR_HANDLING", True)
    )
    cma: bool = field(default_factory=lambda: _env_flag("KVSTATE_UCX_CMA", True))
    tls: str | None = field(default_factory=lambda: os.environ.get("UCX_TLS"))
    rndv_scheme: str | None = field(default_factory=lambda: os.environ.get("UCX_RNDV_SCHEME"))
    #: UCX's RNDV_THRESH for kvstate's context (an option to ucxx.init), None: ucxx's;
    #: see the docstring
    rndv_thresh: str | None = field(
        default_factory=lambda: os.environ.get("KVSTATE_UCX_RNDV_THRESH", "").strip() or None
    )
    #: largest UCX put of host memory in bytes (0: no limit); see the module docstring
    put_chunk: int = field(default_factory=_put_chunk)
    #: threads for one large same-host write (process_vm_writev); see the module docstring
    cma_threads: int = field(default_factory=_cma_threads)
    #: who may ptrace (and so CMA-write into) this process: "off", "any" or a pid
    ptracer: str | int = field(
        default_factory=lambda: cma.parse_ptracer(os.environ.get(cma.PTRACER_ENV))
    )

    def apply_env(self) -> dict[str, str]:
        """Export the UCX variables (UCX reads them once, when ucxx creates its context);
        return the values in effect for the ones kvstate has defaults for."""
        for name, value in UCX_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if self.tls:
            os.environ["UCX_TLS"] = self.tls
        if self.rndv_scheme:
            os.environ["UCX_RNDV_SCHEME"] = self.rndv_scheme
        tx = _size(os.environ["UCX_TCP_TX_SEG_SIZE"])
        rx = _size(os.environ["UCX_TCP_RX_SEG_SIZE"])
        if tx is not None and rx is not None and tx > rx:
            raise TransportError(
                f"UCX_TCP_TX_SEG_SIZE={os.environ['UCX_TCP_TX_SEG_SIZE']} is larger than "
                f"UCX_TCP_RX_SEG_SIZE={os.environ['UCX_TCP_RX_SEG_SIZE']}: UCX refuses that; "
                "set both (kvstate's defaults: 256K and 512K)"
            )
        return {name: os.environ[name] for name in UCX_DEFAULTS}
