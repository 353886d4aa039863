"""Control-plane benchmark (issue 12): what a room lifecycle costs the client and Redis.

One run, on private redis-servers it starts, prints (ratios are taken within the run,
so a busy machine moves them less than the absolute figures):

- the PING bound: redis-py ``ping()`` over a unix socket, and a raw ``PING`` over TCP
  (a plain socket, no client library), in round trips per second, sampled in each of
  8-20 rounds that alternate with the workload's (median and range);
- lifecycles/s, single (one room at a time: KVReceiver/KVSender calls) and batched
  (``--batch`` rooms per step: init_many, poll_many, begin_many, finish_many,
  clear_many), each against the bound = PING/s / round trips of one single lifecycle,
  as the median (and range) of the rounds' ratios, each round against its own PING
  sample (target: batched >= 1.0x per client process);
- Redis command us per lifecycle (INFO commandstats delta; target <= 100) and Redis CPU
  us per lifecycle (INFO cpu, used_cpu_sys + used_cpu_user delta);
- us per call of each script and of MULTI/EXEC (SLOWLOG at threshold 0, a separate pass);
- lifecycles/s that one primary sustains with 1, 2, 4 client processes (batched), the
  same on a 3-primary Cluster, and the scale-out ratio (target >= 2.5x): measured, and
  by Redis CPU (the busiest primary's CPU per lifecycle: what the Cluster could carry
  with clients enough, which a small machine cannot run);
- round trips per scheduler step (poll_many, begin_many, finish_many, clear_many of every
  in-flight room) with 1, 64 and 256 rooms in flight;
- Redis memory per in-flight room (4096 contiguous pages; target <= 1 KiB): the slope of
  INFO used_memory between 1,024 and 4,096 rooms held in WaitingForInput, with MEMORY
  USAGE of one room's keys beside it and the parts of the slope;
- durable mode (``?durable=true``: Success and aborts confirmed by a replica with WAIT)
  against plain mode on the same primaries with one replica each, alternated in the
  same run: round trips per lifecycle, Redis us per lifecycle (commands, and CPU of the
  primaries and of the replicas) and lifecycles/s, single and batched, as ratios;
- the room trace (``kvstate trace ROOM``) at 100%, at the default rate and off, on the
  same server in alternating rounds: round trips, Redis command us, CPU us and commands
  per lifecycle, Redis memory of one room's trace, lifecycles/s against off;
- the scripts by FCALL (the Redis 7 function library) against the EVAL path forced, on
  the same server in alternating rounds: Redis command and CPU us per lifecycle, single
  and batched, and FCALL / EVAL as the median of the rounds' ratios (``--eval`` forces
  the EVAL path for the whole run instead, to set against a run without it);
- ``--pairs N`` alone (issue 33): N engine pairs, one client process each, on a 3-primary
  Cluster, a one-node Cluster and one standalone server (TCP and unix socket) in
  alternating rounds: Redis CPU us per lifecycle of each primary, the busiest against the
  primaries' mean, scale-out by the busiest primary's CPU, the Cluster's total against
  standalone, where each pair's address tracker landed (``--placement spread`` picks
  the addresses so that they spread evenly), and memory per room on each; and the same
  3-primary Cluster with every key of the run on one of its primaries (``cluster3_one``),
  against which the Cluster's total tells what splitting each step over the primaries
  costs.

- ``--tp-shapes`` (a mode of its own): rooms between TP groups of different sizes
  (prefill x decode ranks 2x4, 4x2, 1x4, 4x1) against equal-TP rooms (2x2, 4x4), in
  alternated rounds: round trips per batched step of each rank and Redis CPU per room,
  per rank pair (the routes ``kvstate.tp`` makes) and per participant, each
  heterogeneous shape as a ratio to the equal-TP room of its larger side (issue 33
  target 5: the same round trips, CPU per rank pair <= 1.0x).

``--smoke`` is a check that the tool still runs (seconds; tests/test_tools.py), not a
measurement: 20 lifecycles, one client process, 64 and 256 held rooms.

    python tools/bench_state.py [--quick] [--smoke] [--json] [--lifecycles 2000]
                                [--batch 16] [--procs 1 2 4] [--no-cluster] [--no-durable]
                                [--no-trace] [--no-fcall-vs-eval] [--eval]
                                [--rooms-per-step 16 256 4096 10000]
                                [--tp-shapes [--batch 16] [--rounds 30]]
    python tools/bench_state.py --pairs 8 [--rounds 6] [--batch 16] [--lifecycles 2000]
                                [--placement named|spread] [--smoke] [--json]

Modules: ``workload`` (the lifecycles), ``redis_cost`` (Redis-side counters),
``rounds`` (the PING bound interleaved with the workload), ``deployment`` (one
deployment's figures), ``memory``, ``procs``, ``durable``, ``trace``, ``fcall``,
``tp_shapes``, ``pairs``, ``cli``.
"""
