"""SGLang ranks for the integration tests: real SGLang classes (KVArgs, MetadataBuffers,
ServerArgs, poll_and_all_reduce over gloo, DecodeTransferQueue) around kvstate's
backend. Functions here run in spawned processes (``torch.multiprocessing``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HOST = "127.0.0.1"
BOOTSTRAP_PORT = 18998
DECODE_PORT = 18000
PAGES = 32
PAGE_BYTES = 64
LAYERS = 2
AUX_SLOTS = 8
STATE_SLOTS = 8
STATE_BYTES = 16
ADDR = f"{HOST}:{BOOTSTRAP_PORT}"


def sglang() -> SimpleNamespace:
    """Load the plugin the way SGLang does, then hand out what the tests drive."""
    import torch.distributed as dist
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins import load_plugins

    load_plugins()
    backend = utils.TransferBackend("kvstate")
    return SimpleNamespace(
        dist=dist,
        utils=utils,
        decode=decode,
        prefill=prefill,
        disagg_service=disagg_service,
        KVArgs=KVArgs,
        KVPoll=KVPoll,
        backend=backend,
        Mode=utils.DisaggregationMode,
        cls=lambda kind: utils.get_kv_class(backend, utils.KVClassType(kind)),
    )


def server_args(mode: str, tp: int) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path="dummy",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="kvstate",
        tp_size=tp,
        host=HOST,
        port=DECODE_PORT,
        disaggregation_bootstrap_port=BOOTSTRAP_PORT,
    )


@dataclass
class Rank:
    """One side of one TP rank: its KV pool, metadata buffers, state pool, manager."""

    sg: SimpleNamespace
    mode: str
    rank: int
    tp: int
    seed: int | None
    kv: list[Any] = field(default_factory=list)
    state: Any = None
    meta: Any = None
    mgr: Any = None

    def start(self) -> Rank:
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        gen = torch.Generator().manual_seed(self.seed or 0)

        def buf(n: int) -> Any:
            if self.seed is None:
                return torch.zeros(n, dtype=torch.uint8)
            return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)

        self.kv = [buf(PAGES * PAGE_BYTES) for _ in range(LAYERS * 2)]
        self.state = buf(STATE_SLOTS * STATE_BYTES)
        self.meta = MetadataBuffers(
            AUX_SLOTS, hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4
        )
        if self.seed is not None:
            for t in self.meta_tensors():
                t.view(torch.uint8).view(-1).copy_(buf(t.nbytes))
        args = self.sg.KVArgs()
        args.engine_rank = self.rank
        args.system_dp_rank = 0
        args.pp_rank = 0
        args.page_size = 1
        args.gpu_id = 0
        args.ib_device = ""
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.nbytes for t in self.kv]
        args.kv_item_lens = [PAGE_BYTES] * len(self.kv)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types = ["mamba"]
        args.state_data_ptrs = [[self.state.data_ptr()]]
        args.state_data_lens = [[self.state.nbytes]]
        args.state_item_lens = [[STATE_BYTES]]
        mode = self.sg.Mode.PREFILL if self.mode == "prefill" else self.sg.Mode.DECODE
        self.mgr = self.sg.cls("manager")(args, mode, server_args(self.mode, self.tp))
        return self

    def meta_tensors(self) -> list[Any]:
        ptrs = self.meta.get_buf_infos()[0]
        out = []
        for name in dir(self.meta):
            t = getattr(self.meta, name, None)
            if hasattr(t, "data_ptr") and t.data_ptr() in ptrs:
                out.append(t)
        return sorted(out, key=lambda t: ptrs.index(t.data_ptr()))

    def pages(self, layer: int, idx: np.ndarray) -> bytes:
        v = self.kv[layer].numpy().reshape(PAGES, PAGE_BYTES)
        return v[idx].tobytes()

    def slot(self, idx: int) -> bytes:
        import torch

        return b"".join(
            t[idx : idx + 1].contiguous().view(torch.uint8).numpy().tobytes()
            for t in self.meta_tensors()
        )

    def state_slots(self, idx: np.ndarray) -> bytes:
        return self.state.numpy().reshape(STATE_SLOTS, STATE_BYTES)[idx].tobytes()


def room_plan(k: int, room_base: int) -> dict[str, Any]:
    """Room k: its pages on each side (decode's in another order), aux and state slots."""
    n = 5
    src = np.arange(k * n, k * n + n, dtype=np.int32)
    dst = (PAGES - 1 - src)[::-1].copy()
    return {
        "room": room_base + k,
        "src": src,
        "dst": dst,
        "aux_src": k,
        "aux_dst": AUX_SLOTS - 1 - k,
        "state_src": np.array([k], np.int32),
        "state_dst": np.array([STATE_SLOTS - 1 - k], np.int32),
    }


def decode_req(room: int, slot: int) -> SimpleNamespace:
    req = SimpleNamespace(
        rid=f"req-{room}",
        bootstrap_host=HOST,
        bootstrap_port=BOOTSTRAP_PORT,
        bootstrap_room=room,
        return_logprob=False,
        finished_reason=None,
    )
    return SimpleNamespace(req=req, metadata_buffer_index=slot)


def wait_polls(ok: Any, polls: int = 3) -> bool:
    """True once ``ok()`` holds, within a few polls (a step each)."""
    return any(ok() for _ in range(polls))


def init_group(rank: int, world: int, init_file: str) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return dist.group.WORLD


def lifecycle(rank: int, url: str, init_file: str, out: str, nrooms: int) -> None:
    """Prefill rank r and decode rank r in one process; both TP groups reduce their
    polls over one 2-rank gloo group, as SGLang's schedulers do each step."""
    os.environ["KVSTATE_REDIS_URL"] = url
    sg = sglang()
    group = init_group(rank, 2, init_file)
    p = Rank(sg, "prefill", rank, 2, seed=1000 + rank).start()
    d = Rank(sg, "decode", rank, 2, seed=None).start()
    sg.dist.barrier(group)
    while not d.mgr.try_ensure_parallel_info(ADDR):
        time.sleep(0.05)
    plans = [room_plan(k, 7000) for k in range(nrooms)]
    rx = [sg.cls("receiver")(d.mgr, ADDR, pl["room"]) for pl in plans]
    tx = [sg.cls("sender")(p.mgr, ADDR, pl["room"]) for pl in plans]
    for r in rx:
        r.init(0)
    poll = sg.utils.poll_and_all_reduce
    KVPoll = sg.KVPoll
    meta_sent = [False] * nrooms
    sent = [False] * nrooms
    tx_done = [False] * nrooms
    rx_done = [False] * nrooms
    steps = 0
    seen_rx: list[set[int]] = [set() for _ in range(nrooms)]
    while not (all(tx_done) and all(rx_done)):
        steps += 1
        assert steps < 2000, "lifecycle did not finish"
        # decode: one poll of every queued receiver, metadata gate on Success
        reqs = [decode_req(pl["room"], pl["aux_dst"]) for pl in plans]
        live = [i for i in range(nrooms) if not rx_done[i]]
        polls = poll(
            [rx[i] for i in live],
            group,
            decode_reqs=[reqs[i] for i in live],
            metadata_buffers=d.meta,
        )
        for i, st in zip(live, polls, strict=True):
            seen_rx[i].add(int(st))
            assert st != KVPoll.Failed, f"room {plans[i]['room']} failed"
            if st == KVPoll.WaitingForInput and not meta_sent[i]:
                pl = plans[i]
                rx[i].send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
                meta_sent[i] = True
            elif st == KVPoll.Success:
                rx_done[i] = True
        # prefill: one poll of every sender
        live = [i for i in range(nrooms) if not tx_done[i]]
        polls = poll([tx[i] for i in live], group)
        for i, st in zip(live, polls, strict=True):
            assert st != KVPoll.Failed, f"room {plans[i]['room']} failed on prefill"
            if st == KVPoll.WaitingForInput and not sent[i]:
                pl = plans[i]
                assert tx[i].pop_decode_prefix_len() == 0
                tx[i].init(len(pl["src"]), pl["aux_src"])
                tx[i].send(pl["src"][:3])  # two chunks; the last carries aux and state
                tx[i].send(pl["src"][3:], [pl["state_src"]], num_kv_tokens=2)
                sent[i] = True
            elif st == KVPoll.Success:
                tx_done[i] = True
    result: dict[str, Any] = {
        "steps": steps,
        "tx_batches": p.mgr.batches,
        "rx_batches": d.mgr.batches,
        "seen_rx": [sorted(s) for s in seen_rx],
    }
    mismatch = []
    for pl in plans:
        for layer in range(LAYERS * 2):
            if p.pages(layer, pl["src"]) != d.pages(layer, pl["dst"]):
                mismatch.append(f"room {pl['room']} layer {layer}")
        if p.slot(pl["aux_src"]) != d.slot(pl["aux_dst"]):
            mismatch.append(f"room {pl['room']} aux")
        if d.meta.bootstrap_room[pl["aux_dst"], 0].item() == 0:
            mismatch.append(f"room {pl['room']} metadata gate")
        if p.state_slots(pl["state_src"]) != d.state_slots(pl["state_dst"]):
            mismatch.append(f"room {pl['room']} state")
    result["mismatch"] = mismatch
    result["bytes"] = sum(t.get_transfer_metric().transfer_total_bytes for t in tx)
    for t in tx:
        t.clear()
    for r in rx:
        r.clear()
    sg.dist.barrier(group)
    p.mgr.close()
    d.mgr.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def pair(_index: int, url: str, out: str, scenario: str) -> None:
    """One process with a 1-rank group: prefill and decode rank 0, driven through the
    abort scenarios."""
    os.environ["KVSTATE_REDIS_URL"] = url
    sg = sglang()
    group = init_group(0, 1, os.path.join(out, "gloo"))
    p = Rank(sg, "prefill", 0, 1, seed=5).start()
    d = Rank(sg, "decode", 0, 1, seed=None).start()
    assert d.mgr.try_ensure_parallel_info(ADDR)
    KVPoll = sg.KVPoll
    poll = sg.utils.poll_and_all_reduce
    pl = room_plan(0, 9000)
    rx = sg.cls("receiver")(d.mgr, ADDR, pl["room"])
    rx.init(0)
    tx = sg.cls("sender")(p.mgr, ADDR, pl["room"])
    assert poll([rx], group) == [KVPoll.WaitingForInput]
    rx.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
    # a sender learns how many decode ranks it waits for from their infos (kvstate.tp):
    # it may report WaitingForInput one poll after the info landed
    assert wait_polls(lambda: poll([tx], group) == [KVPoll.WaitingForInput])
    assert poll([rx], group) == [KVPoll.Transferring]
    if scenario == "prefill":
        tx.abort()
    elif scenario == "decode":
        rx.abort()
    elif scenario == "cli":
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstate.cli",
                "abort",
                str(pl["room"]),
                "--reason",
                "operator says no",
            ],
            check=True,
            env=os.environ,
        )
    result = {"tx": int(poll([tx], group)[0]), "rx": int(poll([rx], group)[0])}
    for name, part in (("tx_error", tx), ("rx_error", rx)):
        try:
            part.failure_exception()
        except Exception as exc:  # SGLang's KVTransferError
            result[name] = f"{type(exc).__name__}: {exc}"
    tx.clear()
    rx.clear()
    p.mgr.close()
    d.mgr.close()
    Path(out, "result.json").write_text(json.dumps(result))


def lone(url: str, out: str, role: str, hold: bool) -> None:
    """A single-rank prefill or decode process for the SIGKILL tests: it advances one
    room to the transfer, then (if ``hold``) waits to be killed, or reports how its
    side ended through SGLang's own queue code."""
    os.environ["KVSTATE_REDIS_URL"] = url
    os.environ["KVSTATE_SGLANG_LEASE"] = "1"
    sg = sglang()
    group = init_group(0, 1, os.path.join(out, f"gloo-{role}"))
    KVPoll = sg.KVPoll
    poll = sg.utils.poll_and_all_reduce
    pl = room_plan(0, 9100)
    side = Rank(sg, role, 0, 1, seed=3 if role == "prefill" else None).start()
    Path(out, f"{role}.started").write_text("1")
    ready = Path(out, f"{role}.ready")
    deadline = time.monotonic() + 60
    if role == "decode":
        while not side.mgr.try_ensure_parallel_info(ADDR):
            time.sleep(0.05)
        rx = sg.cls("receiver")(side.mgr, ADDR, pl["room"])
        rx.init(0)
        assert poll([rx], group) == [KVPoll.WaitingForInput]
        rx.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
        ready.write_text("1")
        if hold:
            signal.pause()
        result = transfer_queue_outcome(sg, group, side, rx, pl, deadline)
    else:
        tx = sg.cls("sender")(side.mgr, ADDR, pl["room"])
        while poll([tx], group) != [KVPoll.WaitingForInput]:
            assert time.monotonic() < deadline, "decode never published"
            time.sleep(0.05)
        ready.write_text("1")
        if hold:
            signal.pause()
        while not Path(out, "go").exists():
            time.sleep(0.05)
        tx.init(len(pl["src"]), pl["aux_src"])
        tx.send(pl["src"], [pl["state_src"]])
        result = inflight_queue_outcome(group, tx, pl, deadline)
    side.mgr.close()
    Path(out, f"{role}.json").write_text(json.dumps(result))


def inflight_queue_outcome(
    group: Any, tx: Any, pl: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """Run SGLang's prefill inflight queue (process_disagg_prefill_inflight_queue) on the
    real sender until the room leaves it; report what SGLang did with it. A stand-in
    scheduler, for the reason transfer_queue_outcome gives."""
    from types import MethodType
    from unittest import mock

    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin

    ts = SimpleNamespace(
        trace_ctx=SimpleNamespace(abort=lambda **_k: None),
        set_completion_time=lambda: None,
        set_prefill_kv_transfer_finish_time=lambda: None,
    )
    req = SimpleNamespace(
        rid=f"req-{pl['room']}",
        bootstrap_room=pl["room"],
        bootstrap_host=HOST,
        pending_bootstrap=False,
        disagg_kv_sender=tx,
        finished_reason=None,
        time_stats=ts,
        return_logprob=False,
        return_routed_experts=False,
        metadata_buffer_index=pl["aux_src"],
    )
    freed: list[int] = []
    streamed: list[str] = []
    released: list[str] = []
    sched = SimpleNamespace(
        disagg_prefill_inflight_queue=[req],
        attn_cp_cpu_group=group,
        attn_tp_cpu_group=group,
        tree_cache=None,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(
            stream_output=lambda reqs, *_a: streamed.extend(r.rid for r in reqs)
        ),
        req_to_metadata_buffer_idx_allocator=SimpleNamespace(free=freed.append),
        _release_aborted_request=lambda r: released.append(r.rid),
        scheduler_stage_metrics=None,
    )
    sched.handle_inflight_transfer_failure = MethodType(
        Mixin.handle_inflight_transfer_failure, sched
    )
    done: list[Any] = []
    from sglang.srt.runtime_context import get_parallel

    with (
        mock.patch(
            "sglang.srt.disaggregation.prefill.release_kv_cache",
            lambda r, *_a, **_k: released.append(r.rid),
        ),
        get_parallel().override(tp_rank=0),
    ):
        while sched.disagg_prefill_inflight_queue and time.monotonic() < deadline:
            done += Mixin.process_disagg_prefill_inflight_queue(sched)
            time.sleep(0.1)
    return {
        "left_queue": not sched.disagg_prefill_inflight_queue,
        "done": len(done),
        "abort": getattr(req.finished_reason, "message", None),
        "released": released,
        "freed_slots": freed,
        "streamed": streamed,
    }


def transfer_queue_outcome(
    sg: SimpleNamespace, group: Any, side: Rank, rx: Any, pl: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """Run SGLang's DecodeTransferQueue.pop_transferred on the real receiver until the
    room leaves the queue; report what SGLang did with it.

    The queue is made with ``__new__`` and a stand-in scheduler: its constructor takes a
    Scheduler and reads SGLang's process-wide runtime context (published server args,
    the attention-TP group the scheduler builds), and a Scheduler needs a model runner.
    The real queues (PrefillBootstrapQueue, DecodePreallocQueue, DecodeTransferQueue)
    with a real Scheduler run in test_sglang_e2e and test_sglang_faults (real servers)."""
    from unittest import mock

    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    dreq = decode_req(pl["room"], pl["aux_dst"])
    dreq.kv_receiver = rx
    dreq.hicache_restore_status = None
    dreq.host_staged = False
    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q.queue = [dreq]
    q.enable_staging = False
    q.enable_deferred_kv_release = False
    q.enable_host_receive = False
    q.gloo_group = group
    q.tp_rank = 0
    q.metadata_buffers = side.meta
    q.tree_cache = None
    freed: list[int] = []
    q.req_to_metadata_buffer_idx_allocator = SimpleNamespace(free=freed.append)
    q.spec_algorithm = SimpleNamespace(is_none=lambda: True)
    q._clean_hicache_prefetch_resources = lambda _r: None
    streamed: list[Any] = []
    q.scheduler = SimpleNamespace(
        enable_decode_hicache=False,
        enable_hisparse=False,
        output_streamer=SimpleNamespace(stream_output=lambda reqs, _lp: streamed.extend(reqs)),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        kv_checksum_computer=None,
    )
    released: list[Any] = []
    transferred: list[Any] = []
    # the KV pool and radix tree are not part of this rig: record what SGLang releases
    with mock.patch(
        "sglang.srt.disaggregation.decode.release_kv_cache",
        lambda req, *_a, **_k: released.append(req.rid),
    ):
        while q.queue and time.monotonic() < deadline:
            transferred += q.pop_transferred()
            time.sleep(0.1)
    reason = getattr(dreq.req.finished_reason, "message", None)
    return {
        "left_queue": not q.queue,
        "transferred": len(transferred),
        "abort": reason,
        "released": released,
        "freed_slots": freed,
        "receiver_cleared": dreq.kv_receiver is None,
        "streamed": [r.rid for r in streamed],
    }


def scenarios(_index: int, url: str, out: str) -> None:
    """User reports, one process: duplicate rooms, the room cap, injected rooms' TTLs,
    a worker thread sending while the scheduler thread polls, mirror mode."""
    import threading
    import traceback

    os.environ["KVSTATE_REDIS_URL"] = url
    os.environ["KVSTATE_SGLANG_MAX_ROOMS"] = "40"
    sg = sglang()
    from kvstate.store import connect

    store = connect(url)
    p = Rank(sg, "prefill", 0, 1, seed=9).start()
    d = Rank(sg, "decode", 0, 1, seed=None).start()
    assert d.mgr.try_ensure_parallel_info(ADDR)
    Sender, Receiver = sg.cls("sender"), sg.cls("receiver")
    res: dict[str, Any] = {}

    def error(part: Any) -> str:
        try:
            part.failure_exception()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def run(pl: dict[str, Any], tx: Any, rx: Any, steps: int = 400) -> tuple[int, int]:
        rx.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
        for _ in range(steps):
            st = tx.poll()
            if st == 2:
                tx.init(len(pl["src"]), pl["aux_src"])
                tx.send(pl["src"], [pl["state_src"]])
            elif st in (0, 4):
                break
        for _ in range(steps):
            if rx.poll() in (0, 4):
                break
        return int(tx.poll()), int(rx.poll())

    def check(name: str, fn: Any) -> None:
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"crash": traceback.format_exc()}

    def duplicate_local() -> dict[str, Any]:
        pl = room_plan(0, 11000)
        rx = Receiver(d.mgr, ADDR, pl["room"])
        rx.init(0)
        tx = Sender(p.mgr, ADDR, pl["room"])
        twin = Sender(p.mgr, ADDR, pl["room"])  # a client reused the room
        out = {"twin": int(twin.poll()), "twin_error": error(twin)}
        twin.clear()  # must not clear the first request's state
        out["first"] = run(pl, tx, rx)
        tx.clear()
        rx.clear()
        return out

    def reused_after_abort() -> dict[str, Any]:
        """A client sends a bootstrap_room again after the decode aborted its first
        request and both sides cleared: the second request moves its pages exactly."""
        pl = room_plan(2, 11000)
        tx, rx = Sender(p.mgr, ADDR, pl["room"]), Receiver(d.mgr, ADDR, pl["room"])
        rx.init(0)
        tx.poll()
        rx.abort()
        first = [int(tx.poll()), int(rx.poll())]
        tx.clear()
        rx.clear()
        tx, rx = Sender(p.mgr, ADDR, pl["room"]), Receiver(d.mgr, ADDR, pl["room"])
        rx.init(0)
        second = list(run(pl, tx, rx))
        out = {
            "first": first,
            "second": second,
            "pages_equal": p.pages(0, pl["src"]) == d.pages(0, pl["dst"]),
            "state_equal": p.state_slots(pl["state_src"]) == d.state_slots(pl["state_dst"]),
        }
        tx.clear()
        rx.clear()
        out["keys_left"] = list(store.scan(store.keys.room_prefix(pl["room"]) + "*"))
        return out

    def duplicate_decodes() -> dict[str, Any]:
        import dataclasses

        pl = room_plan(1, 11000)
        other = dataclasses.replace(d, mgr=None)
        saved = os.environ.get("KVSTATE_SGLANG_HOST")
        os.environ["KVSTATE_SGLANG_HOST"] = "127.0.0.2"  # another decode instance
        try:
            other.start()
        finally:
            os.environ.pop("KVSTATE_SGLANG_HOST")
            if saved is not None:
                os.environ["KVSTATE_SGLANG_HOST"] = saved
        assert other.mgr.try_ensure_parallel_info(ADDR)
        tx = Sender(p.mgr, ADDR, pl["room"])
        rxs = [Receiver(m, ADDR, pl["room"]) for m in (d.mgr, other.mgr)]
        for r in rxs:
            r.init(0)
            r.poll()
            r.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
        # the sender learns its count from the first info: it sees the second one (and
        # refuses the pair) within a poll or two
        wait_polls(lambda: tx.poll() == sg.KVPoll.Failed)
        out = {
            "tx": int(tx.poll()),
            "rx": [int(r.poll()) for r in rxs],
            "tx_error": error(tx),
            "rx_error": [error(r) for r in rxs],
        }
        tx.clear()
        for r in rxs:
            r.clear()
        other.mgr.close()
        return out

    def cap_and_ttl() -> dict[str, Any]:
        # rooms injected without a decode request: every key has a TTL; past the cap
        # new rooms are refused instead of growing state
        txs = [Sender(p.mgr, ADDR, 12000 + i) for i in range(41)]
        polls = [int(t.poll()) for t in txs]
        no_ttl = [k for k in store.scan(store.keys.all_pattern) if store.client.pttl(k) < 0]
        out = {
            "polls": polls,
            "refused": error(txs[-1]),
            "no_ttl": no_ttl,
            "rooms": len(p.mgr._rooms),
        }
        for t in txs:
            t.clear()
        out["after_clear"] = len(p.mgr._rooms)
        return out

    def threads() -> dict[str, Any]:
        # SGLang's scheduler thread polls every step while a worker thread sends
        pls = [room_plan(k, 13000) for k in range(4)]
        txs = [Sender(p.mgr, ADDR, pl["room"]) for pl in pls]
        rxs = [Receiver(d.mgr, ADDR, pl["room"]) for pl in pls]
        for r, pl in zip(rxs, pls, strict=True):
            r.init(0)
            r.poll()
            r.send_metadata(pl["dst"], pl["aux_dst"], [pl["state_dst"]], 0)
        errors: list[str] = []
        stop = threading.Event()

        def scheduler() -> None:
            try:
                while not stop.is_set():
                    for t in txs:
                        t.poll()
            except Exception:
                errors.append(traceback.format_exc())

        th = threading.Thread(target=scheduler)
        th.start()
        try:
            for t, pl in zip(txs, pls, strict=True):
                while t.poll() != 2:
                    time.sleep(0.01)
                t.init(len(pl["src"]), pl["aux_src"])
                for i in range(len(pl["src"])):  # one page per chunk
                    t.send(pl["src"][i : i + 1], [pl["state_src"]] if i == 4 else None)
        finally:
            stop.set()
            th.join()
        # polls answer from the step's batch: poll like a scheduler, step after step
        ok = [0] * len(rxs)
        for _ in range(100):
            ok = [int(r.poll()) for r in rxs]
            if all(s in (0, 4) for s in ok):
                break
        same = all(p.pages(0, pl["src"]) == d.pages(0, pl["dst"]) for pl in pls)
        for t in txs:
            t.clear()
        for r in rxs:
            r.clear()
        return {"errors": errors, "rx": ok, "bytes_equal": same}

    def tp_mismatch() -> dict[str, Any]:
        os.environ["KVSTATE_SGLANG_HOST"] = "127.0.0.3"  # a decode instance with TP 2
        try:
            wide = Rank(sg, "decode", 0, 2, seed=None).start()
        finally:
            os.environ.pop("KVSTATE_SGLANG_HOST")
        import logging

        from kvstate.integrations.sglang.metrics import refusal_count

        seen: list[str] = []

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno == logging.WARNING:
                    seen.append(record.getMessage())

        catch = Catch()
        logging.getLogger("kvstate.integrations.sglang.manager").addHandler(catch)
        assert wide.mgr.try_ensure_parallel_info(ADDR)
        rxs = [Receiver(wide.mgr, ADDR, 15000 + k) for k in range(2)]
        for rx in rxs:  # this pool gives no KV heads per rank: refused, not guessed
            rx.init(0)
        out = {
            "rx": [int(rx.poll()) for rx in rxs],
            "error": error(rxs[0]),
            "warnings": seen,
            "refusals": sum(wide.mgr.refusals.values()),
            "metric": refusal_count(ADDR, wide.mgr.engine),
        }
        logging.getLogger("kvstate.integrations.sglang.manager").removeHandler(catch)
        for rx in rxs:
            rx.clear()
        wide.mgr.close()
        return out

    check("tp_mismatch", tp_mismatch)
    check("duplicate_local", duplicate_local)
    check("duplicate_decodes", duplicate_decodes)
    check("reused_after_abort", reused_after_abort)
    check("cap_and_ttl", cap_and_ttl)
    check("threads", threads)
    p.mgr.close()
    d.mgr.close()
    check("mirror", lambda: mirror(sg, url))
    Path(out, "scenarios.json").write_text(json.dumps(res))


def mirror(sg: SimpleNamespace, url: str) -> dict[str, Any]:
    """Mirror mode over SGLang's fake backend (it moves no bytes, as Mooncake would
    move them elsewhere): kvstate records each room and an abort reaches both."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    os.environ["KVSTATE_SGLANG_MIRROR"] = "fake"
    fake = TransferBackend.FAKE
    classes = {k: get_kv_class(fake, KVClassType(k)) for k in ("manager", "sender", "receiver")}
    out: dict[str, Any] = {"classes": {k: c.__name__ for k, c in classes.items()}}
    args = sg.KVArgs()
    args.engine_rank = 0
    args.system_dp_rank = 0
    pm = classes["manager"](args, sg.Mode.PREFILL, server_args("prefill", 1))
    dm = classes["manager"](args, sg.Mode.DECODE, server_args("decode", 1))
    from kvstate.store import connect

    store = connect(url)
    phases: list[Any] = []
    for room, abort in ((14000, False), (14001, True)):
        rx = classes["receiver"](dm, ADDR, room)
        tx = classes["sender"](pm, ADDR, room)
        rx.init(0)
        seen = [int(rx.poll())]
        rx.send_metadata(np.arange(3), 1, None, decode_prefix_len=0)
        seen.append(int(tx.poll()))
        tx.init(3, 0)
        if abort:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvstate.cli",
                    "abort",
                    str(room),
                    "--reason",
                    "mirror abort",
                ],
                check=True,
                env=os.environ,
            )
        tx.send(np.arange(3))
        seen += [int(tx.poll()), int(rx.poll())]
        keys = sorted(
            k.split(":", 2)[2]
            for k in store.scan(store.keys.room_prefix(room) + "*")
            if not k.endswith("}:trace")  # kept after clear on purpose (kvstate.trace)
        )
        phases.append(
            {"seen": seen, "keys": keys, "tx_error": error_of(tx), "rx_error": error_of(rx)}
        )
        tx.clear()
        rx.clear()
    out["rooms"] = phases
    pm.kvstate.close()
    dm.kvstate.close()
    os.environ.pop("KVSTATE_SGLANG_MIRROR")
    return out


def error_of(part: Any) -> str:
    try:
        part.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def pynccl_on_cpu(rank: int, init_file: str, out: str) -> None:
    """What SGLang's CPU engine does when it builds a TP 2 group: a PyNcclCommunicator
    on the CPU device, over a real 2-rank gloo group."""
    from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator

    group = init_group(rank, 2, init_file)
    try:
        comm = PyNcclCommunicator(group, device="cpu")
        result = "disabled" if comm.disabled else "constructed"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    Path(out, f"pynccl{rank}.json").write_text(json.dumps(result))
