"""The connector's worker side: one rank's rooms and pages.

Each worker registers as its own kvstate engine (``vllm@<engine_id>.tp<rank>``, or
``.pp<stage>.tp<rank>`` on a pipeline-parallel prefill, at the address
``vllm@<engine_id>`` shared by the engine's workers) with a lease on the Redis clock,
and its KV buffers with their ``Geometry`` (names, heads per page: layout.py). A decode
rank's receiver reads from the prefill workers ``kvstate.tp`` routes it to (handoff.py:
every head it holds from one prefill rank, on every pipeline stage; prefill ranks no
decode rank reads from get a dummy route), and declares how many decode ranks each
serves; a prefill worker's sender waits for as many (``required_receivers=None``).

Per step the worker's work runs behind vLLM's (``KVManager.run_behind``: the manager's
own thread; what a run does: rooms.py), as NIXL's transfers run on its agent's threads:
``start_load_kv`` hands over the step's new rooms and aborts and starts a run if none
runs and it has anything to do (``Rooms.due``: rooms that wait unchanged start none), so
the run works while the forward does; ``get_finished`` reports what the runs that ended
concluded. A hook makes no round trip and waits for none (a step without a forward lets
go of the GIL a moment: ``LET_GO_S``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from typing import Any

from kvstate.errors import KVStateError, VLLMConfigError
from kvstate.integrations.vllm.groups import groups_of
from kvstate.integrations.vllm.handoff import KVFacts
from kvstate.integrations.vllm.layout import BLOCK_OUTER, buffers, layout_name
from kvstate.integrations.vllm.metrics import KVStateConnectorStats
from kvstate.integrations.vllm.rooms import Outcome, Rooms
from kvstate.integrations.vllm.scheduler import KVStateConnectorMetadata
from kvstate.integrations.vllm.settings import Settings, rank_name
from kvstate.roles import KVManager
from kvstate.store import Store, connect
from transports.base import Transport

log = logging.getLogger(__name__)
#: a step whose forward took less (``start_load_kv`` to ``get_finished``) gave the run
#: behind it no time without the GIL, as vLLM's steps without a forward do while
#: requests wait for their KV: ``get_finished`` then lets go of the GIL for up to
#: ``LET_GO_S`` for a run that has not ended, which would otherwise get the GIL only at
#: the interpreter's switch interval (5 ms) after each of its round trips
SHORT_FORWARD_S = 1e-3
LET_GO_S = 1e-4


def parallel_ranks() -> tuple[int, int]:
    """This process's (tensor-parallel rank, pipeline stage): (0, 0) outside groups."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return int(ps.get_tensor_model_parallel_rank()), int(ps.get_pp_group().rank_in_group)
    return 0, 0


def check_parallel(vllm_config: Any, producer: bool) -> None:
    """Refuse at start-up what kvstate does not move: a pipeline-parallel decode (a
    prefill writes each of its layers into one decode worker per TP rank; NixlConnector
    refuses it too)."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp > 1 and not producer:
        raise VLLMConfigError(
            f"pipeline_parallel_size {pp} on a decode (kv_consumer) engine: KVStateConnector "
            "moves a prefill's KV into one decode worker per TP rank holding every layer; "
            "run the decode with pipeline_parallel_size 1 (a prefill may use pipeline "
            "parallelism)"
        )


class WorkerSide:
    """One worker: registration, the rooms of its requests, the pages."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: Settings,
        engine: str,
        producer: bool,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.engine = engine
        self.producer = producer
        parallel = vllm_config.parallel_config
        self.tp = int(parallel.tensor_parallel_size)
        self.pp = int(parallel.pipeline_parallel_size)
        self.rank, self.stage = parallel_ranks()
        self.name = rank_name(engine, self.rank, self.stage, self.pp)
        self.stats = KVStateConnectorStats()
        self.store: Store | None = None
        self.mgr: KVManager | None = None
        self.transport: Transport | None = None
        # what the main thread hands over and takes back (the runs behind touch the rest)
        self._metas: list[KVStateConnectorMetadata] = []  # handed over, not run yet
        self._run: Future[Outcome] | None = None  # the run behind the step
        self._out = Outcome()  # what ended runs concluded, for the next get_finished
        self._started = False  # start() ran this step (and started the run if it could)
        self._t_start = 0.0  # when it ran (perf_counter)
        self._load_errors: set[int] = set()  # reported by the next get_finished's caller
        self._failed: set[str] = set()  # loads that failed, by request
        self.rooms: Rooms | None = None  # only the runs behind the steps touch them

    # -- start-up -------------------------------------------------------------------
    def _check_device(self, kv_caches: dict[str, Any]) -> None:
        """``kv_buffer_device`` must name the device the KV cache lives on: kvstate moves
        it from there (UCX registers device memory), it never stages it through host
        buffers, so another value is refused rather than ignored."""
        asked = str(getattr(self.vllm_config.kv_transfer_config, "kv_buffer_device", "") or "")
        devices = sorted({str(t.device.type) for t in kv_caches.values()})
        if asked and devices != [asked]:
            raise VLLMConfigError(
                f"kv_buffer_device={asked!r}, but the KV cache is on {'/'.join(devices)}: "
                "KVStateConnector moves the KV cache where it lives (its UCX transport "
                "registers device memory) and does not stage it through host buffers; "
                f"leave kv_buffer_device unset or set it to {devices[0]!r}"
            )

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Check the caches, register the pages with their geometry, start the lease."""
        from transports.ucx import UCXTransport

        self._check_device(kv_caches)
        layout = layout_name(self.vllm_config, self.kv_cache_config)
        if self.pp > 1 and layout in BLOCK_OUTER:
            raise VLLMConfigError(
                f"pipeline_parallel_size {self.pp} with KV cache layout {layout}: a block "
                "there holds every layer of a stage in one run, which cannot meet the "
                "decode's layers by name; use a layer-outer layout (LBHNC, LBNHC)"
            )
        runs = buffers(kv_caches, self.kv_cache_config, layout)
        self.store = connect(self.settings.redis_url, self.settings.namespace)
        transport = UCXTransport()
        try:
            transport.register_buffers(
                [b.tensor for b in runs], [b.page_bytes for b in runs], [b.geometry for b in runs]
            )
            s = self.settings
            self.mgr = KVManager(
                self.store,
                "prefill" if self.producer else "decode",
                self.name,
                self.engine,
                transport,
                lease=s.lease,
                bootstrap_timeout=s.bootstrap_timeout,
                waiting_timeout=s.waiting_timeout,
                transfer_timeout=s.transfer_timeout,
                ranks=self.tp * self.pp,
            )
        except BaseException:
            transport.close()
            raise
        self.transport = transport
        facts = KVFacts.of(self.vllm_config, self.kv_cache_config)
        by_request = len(groups_of(self.kv_cache_config)) > 1
        self.rooms = Rooms(self.mgr, facts, self.name, self.rank, by_request)
        g = runs[0].geometry
        log.info(
            "%s: %d KV runs registered (layout %s, %d blocks, %s heads x %s a page)",
            self.name,
            len(runs),
            layout,
            self.kv_cache_config.num_blocks,
            g.heads or "whole",
            g.outer,
        )

    # -- per step (the main thread) -------------------------------------------------
    def start(self, meta: KVStateConnectorMetadata) -> None:
        """This step's new rooms and aborts, handed to the run behind the step, which
        starts now if none runs: it polls, pushes and publishes during the forward, and
        this step's ``get_finished`` reports what it concluded if it ended by then."""
        if self.rooms is None:
            return
        if meta.send or meta.recv or meta.abort:
            self._metas.append(meta)
        self._next(start=True)
        self._started, self._t_start = True, time.perf_counter()

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks the prefill may free, requests whose load ended), as
        the runs that ended since the last call concluded; a run is started here only
        in a step whose ``start`` was not called."""
        started, self._started = self._started, False
        short = not started or time.perf_counter() - self._t_start < SHORT_FORWARD_S
        if self._run is not None and short:  # the run takes the GIL, a moment at most
            wait([self._run], LET_GO_S)
        self._next(start=not started)
        out, self._out = self._out, Outcome()
        self._load_errors |= out.load_errors
        self._failed |= out.failed
        if not out.stats.is_empty():
            self.stats.aggregate(out.stats)
        return out.sent, out.loaded

    def _next(self, start: bool) -> None:
        """Take the outcome of a run that ended (what it raised is raised here) and,
        when none runs and ``start``, start the next if it has anything to do: rooms
        handed over, rooms to look at or finish, a room in flight that may have moved,
        clears (rooms that wait unchanged start none)."""
        rooms, run = self.rooms, self._run
        if rooms is None or (run is not None and not run.done()):
            return
        if run is not None:
            self._run = None
            self._out.merge(run.result())
        if start and (self._metas or rooms.due()):
            metas, self._metas = self._metas, []
            self._run = rooms.mgr.run_behind(lambda: rooms.run(metas))

    def idle(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the run behind the step to end; True when
        none runs. A serving step never waits (its hooks look at ``done()``); tests and
        benchmarks call it to emulate a forward that lasts as long as the run."""
        run = self._run
        return run is None or bool(wait([run], timeout).done)

    def _settle(self) -> None:
        """Wait for the run behind (shutdown); its outcome is dropped with the engine."""
        run, self._run = self._run, None
        if run is not None:
            try:
                run.result()
            except Exception as exc:  # shutting down: logged, not raised
                log.warning("%s: the run behind the step failed: %s", self.name, exc)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def failed_loads(self) -> set[str]:
        """Requests whose load failed (hybrid models), reported with their finish."""
        failed, self._failed = self._failed, set()
        return failed

    def get_stats(self) -> KVStateConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        """Fail and clear what this rank still holds (the other side learns it on its
        next poll), then drop the lease."""
        rooms = self.rooms
        if rooms is not None:
            self._settle()  # the run behind ends first
            for meta in self._metas:  # rooms handed over since: made, to fail them too
                try:
                    rooms.begin(meta, Outcome())
                except KVStateError as exc:
                    log.warning("%s: rooms handed over at shutdown: %s", self.name, exc)
            self._metas.clear()
            rooms.shut(f"engine {self.name} shut down")
            rooms.mgr.close()
        if self.transport is not None:
            self.transport.close()
        if self.store is not None:
            self.store.close()
        self.mgr = self.transport = self.store = self.rooms = None


__all__ = ["WorkerSide", "check_parallel", "parallel_ranks"]
