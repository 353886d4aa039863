"""``kvstate demo``: the end-to-end run (docs/design.md, Zero setup).

The parent process is the *router*: it spawns prefill and decode workers, each with its
own KV pool registered with a UCX transport and its own :class:`KVManager`, then pushes
requests through them. Per room the router picks a prefill and a decode worker and a
room id and sends both the request over a multiprocessing queue (the router's job in a
real deployment); everything about the room's *state* goes through Redis only. The
decode worker checks every byte of every page it received against a pattern derived
from (room, page, layer), so a success that moved the wrong bytes cannot pass.

For containers (docker-compose) the router can serve its queues over TCP (``--listen``)
and workers started as ``kvstate demo --worker prefill --engine prefill-0 --router
HOST:PORT`` attach to it; the bytes and the state then move exactly as in the
one-machine run. Those queues carry pickles, so both sides need the secret in
``$KVSTATE_DEMO_AUTHKEY``.

Operators: ``--hold`` keeps rooms visible to ``kvstate ls/show``, which find a running
demo's embedded server through its discovery record; SIGINT/SIGTERM make every worker
clear its rooms in flight before a partial summary (exit 130/143).

Modules, one concept each, in the order a run uses them:

* ``messages``: what the router and the workers say to each other (frozen dataclasses);
* ``pattern``: the bytes a room must carry, and the KV pools they live in;
* ``queues``: how messages travel (spawn queues and pipes, or TCP with ``--listen``);
* ``workers``: the loop every worker runs; ``engines``: what prefill and decode do in it;
* ``router``: starting workers, dispatching rooms, fault injection, collecting results;
* ``outcome``: how a room ended; ``summary``: what was measured, the printed summary;
* ``run``: one run start to finish; ``command``: the click command.

UCX is an extra (``kvstate[ucx]``): nothing here imports it until a worker starts.
"""

from kvstate.demo.command import demo
from kvstate.demo.engines import decode_worker, prefill_worker
from kvstate.demo.messages import Job, Result, WorkerConfig
from kvstate.demo.pattern import expected_pages

__all__ = [
    "Job",
    "Result",
    "WorkerConfig",
    "decode_worker",
    "demo",
    "expected_pages",
    "prefill_worker",
]
