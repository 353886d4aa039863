"""An engine (vLLM's Scheduler in this process, its ranks in worker processes) and the
router's part: prefill with max_tokens=1, hand its kv_transfer_params to the decode."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.helpers import wait_for
from tests.integrations.vllm_rig import Spec, Workers, dp_configs, plan, vllm_config


class Engine:
    """EngineCore's loop around vLLM's v1 Scheduler; what came out, per request."""

    def __init__(self, spec: Spec, wait: bool = True, config: Any = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.config = config or vllm_config(spec)
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        configs, sched_config = plan(spec, self.config)
        # EngineCore's: the LCM of the groups' block sizes (the one block size but for
        # hybrid models), and the block size block hashes use
        block_size, hash_size = resolve_kv_cache_block_sizes(sched_config, self.config)
        for c in (*configs, sched_config):
            c.hash_block_size = hash_size
        self.workers = Workers(spec, self.config, configs)  # register_kv_caches runs there
        try:
            if wait:
                self.workers.ready()
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=sched_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=block_size,
                hash_block_size=hash_size,
                log_stats=True,
            )
        except BaseException:  # an engine that cannot start leaves no worker behind
            self.workers.kill()
            raise
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(hash_size, sha256)
        self.aggregator = KVOutputAggregator(spec.world)
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.params: dict[str, dict[str, Any]] = {}
        self.bytes_verified = [0] * spec.world
        self.mismatches: list[str] = []
        self.steps = 0
        self.preempted = 0
        self.first_computed: dict[str, int] = {}  # tokens a request had when first run
        self.dead = False
        self.meta: Any = None
        self.kv_stats: list[Any] = []  # SchedulerStats that carried connector stats

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: Any = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": dict(params)} if params else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.tokens[rid] = []
        self.scheduler.add_request(Request(rid, list(prompt), sp, None, block_hasher=self.hasher))

    def submit(
        self,
        external_id: str,
        prompt: list[int],
        max_tokens: int,
        params: Any = None,
        trace_headers: dict[str, str] | None = None,
    ) -> str:
        """A request as vLLM's front end hands it over: an EngineCoreRequest whose id
        vLLM's InputProcessor assigns (a random suffix, unless
        VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1), made a Request by vLLM. Returns the
        id the engine knows it by. ``trace_headers``: what vLLM's front end passes on from
        the HTTP request (``traceparent``)."""
        import time

        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": dict(params)} if params else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        core = EngineCoreRequest(
            external_id,
            list(prompt),
            None,
            sp,
            None,
            time.time(),
            None,
            None,
            None,
            trace_headers=trace_headers,
        )
        InputProcessor.assign_request_id(core)
        self.tokens[core.request_id] = []
        self.scheduler.add_request(Request.from_engine_core_request(core, self.hasher))
        return str(core.request_id)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self) -> bool:
        """EngineCore.step(): False when the scheduler had nothing (or the engine died)."""
        if self.dead or not self.scheduler.has_requests():
            return False
        so = self.scheduler.schedule()
        self.meta = so.kv_connector_metadata  # what this step told the workers
        self.preempted += len(so.preempted_req_ids or ())
        for new in so.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        outs = self.workers.run(so)
        for rank, (_, (verified, bad)) in enumerate(outs):
            self.bytes_verified[rank] = verified
            self.mismatches += bad
        mros = [o for o, _ in outs]
        last = self.spec.world - self.spec.tp  # the last stage's first rank samples
        mro = self.aggregator.aggregate(mros, last) if len(mros) > 1 else mros[0]
        for client in self.scheduler.update_from_output(so, mro).values():
            stats = client.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.kv_stats.append(stats)  # what vLLM's stat loggers get
            for o in client.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
                if o.kv_transfer_params:
                    self.params[o.request_id] = o.kv_transfer_params
        self.steps += 1
        return True

    def held(self) -> int:
        """Blocks not free (the null block aside)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks)

    def problems(self) -> list[str]:
        """What an empty scheduler would not have: requests, queued ones, held blocks."""
        s = self.scheduler
        out = []
        if s.requests:
            out.append(f"requests left: {sorted(s.requests)}")
        if len(s.waiting) or s.running:
            out.append(f"queued: {len(s.waiting)} waiting, {len(s.running)} running")
        if self.held():
            out.append(f"{self.held()} blocks held")
        if any(b.ref_cnt for b in s.kv_cache_manager.block_pool.blocks):
            out.append("blocks with references")
        return out

    def kill(self) -> None:
        self.workers.kill()
        self.dead = True

    def close(self) -> None:
        print(f"engine {self.spec.engine_id}: {sum(self.bytes_verified)} KV bytes read back")
        if not self.dead:
            self.workers.stop()
        self.scheduler.shutdown()


def start(specs: list[Spec], tries: int = 3) -> list[Engine]:
    """Engines whose ranks start side by side (start-up is mostly imports); a spec of
    ``dp`` data-parallel engines starts them all (vLLM's copies of its config). A start
    that lost a rendezvous port vLLM had picked free (EADDRINUSE: another process took
    it meanwhile) is tried again with fresh configs, which pick fresh ports."""
    for attempt in range(tries):
        engines: list[Engine] = []
        try:
            for s in specs:
                configs = dp_configs(s) if s.dp > 1 else [None]
                engines += [Engine(s, wait=False, config=c) for c in configs]
            for e in engines:
                e.workers.ready()
            return engines
        except BaseException as exc:
            for e in engines:
                e.kill()
            if "EADDRINUSE" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


SWEEP_S = 3.0  # a few change-notice sweeps (1 s each): see drive()


def drive(
    engines: list[Engine], until: Callable[[], bool], max_steps: int = 400, pause: float = 0.0
) -> int:
    """Step the engines in turn until ``until()``; returns the rounds it took. Past
    ``max_steps`` rounds it goes on until SWEEP_S has passed too: a change nobody
    notifies (a value written by hand, a timeout) reaches a waiting room at its change
    notices' sweep (Options.notice_sweep, 1 s), which fast rounds can outrun."""
    deadline = time.monotonic() + SWEEP_S
    n = 0
    while n < max_steps or time.monotonic() < deadline:
        if until():
            return n
        stepped = [e.step() for e in engines]
        if pause or not any(stepped):
            time.sleep(pause or 0.02)
        n += 1
    raise AssertionError(f"not done after {n} rounds")


def prefill(p: Engine, rid: str, prompt: list[int]) -> dict[str, Any]:
    """The router's first leg: one token on the prefill engine, its kv_transfer_params."""
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    drive([p], lambda: rid in p.finished)
    return p.params[rid]


def settle(p: Engine, d: Engine, max_steps: int = 400) -> None:
    """Run both engines until neither has anything left."""
    drive([p, d], lambda: not (p.scheduler.has_requests() or d.scheduler.has_requests()), max_steps)


def room_keys(url: str) -> list[str]:
    """Every room key in Redis (engine registrations aside) but rooms' failure marks and
    traces, which outlive clear() on purpose (docs/design.md): each must have its TTL."""
    import redis

    with redis.Redis.from_url(url) as c:
        keys = sorted(k.decode() for k in c.scan_iter("kvstate:*{*"))
        kept = [k for k in keys if k.endswith(("}:aborted", "}:trace"))]
        assert all(c.pttl(k) > 0 for k in kept), kept
    return [k for k in keys if k not in kept]


def keys_left(url: str, within: float = 5.0) -> list[str]:
    """``room_keys`` once the clears made behind the last steps ran (a rank's last
    rooms are cleared behind its step: ``clear_many(wait=False)``), or after
    ``within`` s: what is left then."""
    wait_for(lambda: not room_keys(url), within)
    return room_keys(url)


def ask(p: Engine, d: Engine, rid: str, prompt: list[int], n: int) -> None:
    """The whole route: prefill, then the decode with the prefill's params."""
    d.add(rid, prompt, n, prefill(p, rid, prompt))
