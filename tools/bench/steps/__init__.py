"""What kvstate's vLLM connector costs a scheduler step (issue 33 target 3), beside
NixlConnector's scheduler side on the same vLLM 0.34 utilities.

Two engines per connector in this process, each vLLM's own v1 Scheduler on its own
config and KV cache planning (TP 1, CPU), one local request always running so every
step has a forward (emulated: one token per scheduled request); kvstate's worker-side
connector runs beside its scheduler (the real one: UCX transport, KV caches allocated
as vLLM does, pages moved between the two engines). With ``n`` requests at a time
(``--counts``, default 0 1 64 256) the requests go through the phases of a P/D route
(``vllm_steps.PHASES``) and every step's hooks are timed:

- scheduler side (both connectors): ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``,
  ``update_connector_output``;
- worker side: ``start_load_kv``, ``get_finished``. NixlConnector's runs where NIXL is
  installed in the vLLM venv (``nixl.py``: its agent, side channel and reads, on
  vLLM's CPU platform); without it, NIXL's loads never conclude and its phases end
  with an abort (``nixl_worker_side`` in the JSON says which).

Per phase and count: hook us per step (median and mean; scheduler side, worker side,
both) and the phase's total (ms: work a step leaves to the next shows there), Redis
round trips per step of the engine's thread (most and mean; counted at the socket, the
KVManagers' heartbeat threads apart) and those made behind the steps (kvstate's worker
runs its step's work behind it, ``KVManager.run_behind``: the phase's total and the
most in one step), the ms those runs took (``behind_ms_total``: on a thread that shares
the GIL with the engine's, hidden where a forward lets go of it: ``--forward-ms``), hook
calls, and the hooks of kvstate's push steps (the prefill's steps during which its pages
moved: median us); the ratios of
kvstate to NIXL per step (scheduler sides; both sides where NIXL's worker ran); the
targets (0 round trips a step with nothing in flight, at most 1 otherwise). One
redis-server of its own.

    python tools/bench_vllm_steps.py [--counts 0 1 64 256] [--steps 20] [--forward-ms 0]
        [--layers 2] [--json] [--smoke]

``--layers``: the model's attention layers (a real model's 32 or more: each is a KV
cache both connectors register, K and V side by side: a push writes one buffer each).

Needs vLLM 0.34 (the [vllm] extra). Modules: ``engine`` (one engine, its hooks timed),
``nixl`` (NIXL's worker side), ``vllm_steps`` (the phases, the figures), ``cli``.
SGLang's queues: ``tools/bench_sglang_steps.py``.
"""
