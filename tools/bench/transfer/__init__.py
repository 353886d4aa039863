"""Data-plane benchmark: KV pages between two processes, side by side with baselines.

Moves the same pages (default 4 layers x 1024 pages x 16 KiB = 4096 pages,
64 MiB) contiguously and fragmented (runs of 1-8 pages at random places on
both sides), each system in its own pair of ``spawn``-ed processes:

* kvstate ``UCXTransport`` with its defaults. Every row names the path it
  measures: **CMA** (same host, host memory: batched ``process_vm_writev``, a
  large write split over two threads) or **UCX** (``ucp_put_nbx`` of at most
  64 KiB each + flush, error handling on: other hosts, GPU memory, or
  ``KVSTATE_UCX_CMA=0``); ``--extra`` adds kvstate rows with other settings;
* raw ``ucxx``: all bytes as one tagged message plus a 1-byte ack, tuned
  (``UCX_RNDV_SCHEME=put_zcopy``), error handling off (its fastest) and on;
* the peers, when installed, each with every setting that was its best in some
  run here, one row per setting; ratios take the best row of the run:
  NIXL 1.5 (UCX backend; error handling off and on; UCX's own TCP segment
  sizes and kvstate's 256K/512K, which NIXL's UCX reads from the environment
  too; transfer prepared once and re-posted) and Mooncake Transfer Engine
  (``tcp``, ``--mooncake-lanes``, default 1, 2, 4, 8 and 16 lanes);
* a plain TCP socket (gather/scatter ``sendmsg``/``recv_into``);
* numpy memcpy inside one process (the ceiling on one host), timed in turn
  like the rest, and once more alone after the run (the old, kinder figure).

``--cross-host`` puts the receiver and the sender in two network namespaces
joined by a veth pair that the tool creates (10.231.0.1/2, inside those
namespaces only; removed afterwards), CMA off and every UCX user on
``UCX_TLS=tcp``: the stand-in for two hosts on one machine. Where namespaces
cannot be made (not root, no ``ip``), it falls back to loopback with CMA off
and says so.

Every system gets the same warm-up and reps: all pairs are started first, then
timed in turn one rep at a time, in a new random order every rep (layouts
alternating within a rep; the pairs not being timed are SIGSTOPped), so load
from elsewhere, and whatever ran just before, hits them alike; the receiver's
bytes are checked (SHA-256 of every layer) after the timed part.
Figures: median GB/s and the spread (slowest..fastest rep). Compare ratios
within one run only: the host may be shared (the load average is printed).

Usage: ``python tools/bench_transfer.py [--cross-host] [--json] [--plot out.png] [--reps N]
[--mooncake-lanes 1,2,4,8,16] [--extra NAME:VAR=VALUE,...] [--skip ...]``
(``--plot`` runs both the same-host and the cross-host set).

Modules: ``workload`` (the pages, layouts and checks), ``systems`` (the rows),
``sites`` (same host, network namespaces), ``runs`` (what each side is given per run),
``rx`` and ``tx`` (the two processes), ``drivers`` (the sender side of each system),
``pair``, ``timing`` (a mode's systems timed in turn), ``ratios``, ``plot``, ``cli``.
"""
