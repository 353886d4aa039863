"""UCX transport on ``ucxx``: one-sided writes of page runs, complete before returning.

Needs the ``ucx`` extra (``pip install 'kvstate[ucx]'``); importing this package
without ucxx raises ImportError saying so.

How a write moves bytes
    The receiver registers its buffers (``ucp_mem_map``) and publishes, in
    ``layout()``, their addresses, page sizes, packed UCX remote keys and who it
    is (boot id, pid namespace, pid, start time); ``endpoint()`` is its UCX
    worker address. The sender merges the pages into runs contiguous on both
    sides (``transports.pages``) and then, per target:

    * same host, host memory on both sides: ``process_vm_writev`` with up to
      1024 runs per system call, a write of 8 MiB or more split by bytes over
      two threads (``transports.cma``); when it returns the bytes are in the
      receiver's pages;
    * otherwise (another host, GPU memory, a kernel that refuses CMA):
      ``ucp_put_nbx`` per run and layer (host memory in puts of at most 64
      KiB), all posted before any wait, then ``ucp_ep_flush_nbx``; the flush
      completes only when every put is complete at the receiver.

    Over RDMA or CMA the receiver's CPU takes no part; over TCP, UCX emulates
    puts with active messages that the receiver's UCX thread copies in.
    ``write`` returns only after remote completion, or raises
    :class:`TransportError` with a reason.

Why this split (measured here, 2 vCPUs, UCX 1.21; ``tools/bench_transfer.py``)
    * ucxx 0.52 has no RMA in Python; a Python-level message costs 55-200 us,
      so one message per run made fragmented transfers 4x slower. Puts go
      through ctypes on the libucp that ucxx loaded (~3 us per put to post).
    * Without error handling, a put into a process that has died aborts the
      sender inside UCX's CMA lane (``cma_ep.c`` logs the failed
      ``process_vm_writev`` at fatal level; seen with a SIGKILLed receiver). With
      error handling on, UCX 1.21 keeps a cma lane on one host only when its
      rendezvous threshold is infinite (ucxx sets 8192; kvstate passes ``inf``:
      ``settings``), and then a dead receiver fails the write instead
      (``tests/test_transport.py``, receiver killed mid-transfer, UCX path).
      Issuing the system call ourselves is still faster (4.5-9 GB/s, two
      threads, on par with an in-process memcpy) and turns a dead peer into
      ESRCH, so host memory on one host takes it by default.
    * Packing runs into a staging buffer and scattering on the receiver would
      add two copies on a 2-core host; not needed with either path above.

Settings
    Error handling, CMA, progress mode, UCX's TCP segment sizes, the ptrace
    policy: each with its default, override and measurement in
    ``transports.ucx.settings``.

Threads and processes
    ``ucxx``'s asyncio loop lives in one daemon thread per process, shared by
    every ``UCXTransport`` in it; public methods are synchronous and wait with
    a deadline. Same-host copies run on the calling thread (the system call
    releases the GIL). Start processes that use UCX with the multiprocessing
    ``spawn`` method and create the transport after starting them.

Limits
    Device arrays (``__cuda_array_interface__``) are registered in place; UCX
    does not synchronise CUDA streams, so finish writing the KV pages before
    ``write``. One-sided writes cannot be refused by the receiver: a sender
    that outlives a room's deadline could still write that room's pages, so
    the caller must not hand pages of a failed room to a new request until the
    sender is known to have stopped (kvstate's room state does that).
    At start-up only the UCX version is checked (1.16-1.x; tested with 1.21
    from ``libucx-cu12``); the ctypes struct layouts and constants in ``abi``
    are checked against the installed UCX headers by ``tests/test_ucx_abi.py``.

Modules
    ``abi`` (the ctypes declarations of libucp: the only file tied to UCX's
    binary interface), ``settings`` (defaults and knobs, with the measurements
    behind them), ``runtime`` (the UCX thread), ``plan`` (buffers, peers,
    transfer plans), ``puts`` (the UCX path), ``transport`` (``UCXTransport``).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("ucxx") is None:
    raise ImportError(
        "transports.ucx needs ucxx, which the core install leaves out: pip install 'kvstate[ucx]'",
        name="ucxx",
    )

from transports.ucx.pairing import LAYOUT_VERSION  # noqa: E402
from transports.ucx.runtime import run_on_ucx_thread  # noqa: E402
from transports.ucx.settings import UCX_DEFAULTS, UCXSettings  # noqa: E402
from transports.ucx.transport import UCXTransport  # noqa: E402

__all__ = ["LAYOUT_VERSION", "UCX_DEFAULTS", "UCXSettings", "UCXTransport", "run_on_ucx_thread"]
