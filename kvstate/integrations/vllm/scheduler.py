"""The connector's scheduler side: which requests become rooms, and what each step's
workers must do with them (KVStateConnectorMetadata).

Prefill: a request that finishes with ``do_remote_decode`` keeps its blocks
(``request_finished`` -> True) and hands the router ``kvstate_room`` (derived from the
engine, the request id and a fresh nonce, ``kvstate_nonce``: a request id used again is
a new room), the prefill engine's name and its KV facts (handoff.py); its workers hold
the blocks as the room's senders until the room concludes, then report
``finished_sending``.

Decode: a request carrying those params loads its prompt asynchronously
(``get_num_new_matched_tokens``) when handoff.py says the two engines can move its KV;
``update_state_after_alloc`` gives its workers the blocks to publish. A request that ends
before its load concluded (an abort), or that needs nothing loaded (a full local prefix
hit, or KV this engine cannot take: then it is computed here, with a WARNING once per
prefill engine and reason, and counted), aborts its room from here, so the prefill
frees its blocks on its next step.

Holds: while a request waits in the decode's queue, its room is held
(``Store.hold_many``, renewed every ``HOLD_EVERY`` s for ``HOLD_FOR`` s), so that the
prefill's ``bootstrap_timeout`` does not free blocks a queued request will still load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from kvstate.errors import KVStateError, LayoutRefusedError
from kvstate.integrations.vllm.groups import flatten, groups_of, transfer_ids, wanted
from kvstate.integrations.vllm.handoff import KVFacts, refusal
from kvstate.integrations.vllm.metrics import KVStateConnectorStats
from kvstate.integrations.vllm.settings import Settings, new_nonce, room_of
from kvstate.store import Store, connect
from kvstate.trace import traceparent

log = logging.getLogger(__name__)
HOLD_EVERY = 2.0  # s between two renewals of the decode queue's holds
HOLD_FOR = 8.0  # s each renewal holds the queued rooms for
#: how a prefill request ends when its KV goes to a decode (any other end: aborted or
#: failed on the prefill, nothing handed over)
HANDED_OVER = frozenset({RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED})


@dataclass(frozen=True)
class Load:
    """One decode request's load: its room, the prefill engine and its facts, the
    blocks to publish."""

    room: int
    remote: str
    facts: KVFacts
    blocks: list[int]  # every KV cache group's, group after group (groups.py)
    refused: str = ""  # why this load cannot be made (its blocks then fail)


@dataclass
class KVStateConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: rooms to publish into (decode) or to send
    (prefill), each with the request's block ids (a prefill's per KV cache group), and
    loads to abort (with why)."""

    recv: dict[str, Load] = field(default_factory=dict)
    send: dict[str, tuple[int, list[list[int]]]] = field(default_factory=dict)
    abort: dict[str, str] = field(default_factory=dict)
    # the requests' W3C traceparents (vLLM's trace headers), for a traced room's trace
    traces: dict[str, str] = field(default_factory=dict)


class SchedulerSide:
    """Requests -> rooms, in the scheduler process."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        settings: Settings,
        engine: str,
        engine_id: str,
        producer: bool,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_id = engine_id
        self.producer = producer
        self.facts = KVFacts.of(vllm_config, kv_cache_config) if kv_cache_config else None
        self.groups = groups_of(kv_cache_config) if kv_cache_config else []
        self.transfer = transfer_ids(kv_cache_config) if kv_cache_config else ()
        self.hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
        )
        # the facts as params once (every request hands them on), and each prefill's
        # facts read and judged once: these hooks run for every request of a step
        self._facts_params = self.facts.params() if self.facts is not None else None
        self._judged: dict[tuple[Any, ...], tuple[KVFacts | None, str]] = {}
        self.stats = KVStateConnectorStats()
        self._store: Store | None = None
        self._recv: dict[str, Load] = {}
        self._send: dict[str, tuple[int, list[list[int]]]] = {}
        self._aborts: dict[str, str] = {}
        self._traces: dict[str, str] = {}
        self._loading: dict[str, int] = {}  # decode requests whose load has not concluded
        self._queued: dict[str, int] = {}  # decode requests waiting: their rooms are held
        self._held_at = 0.0
        self._warned: set[tuple[str, str]] = set()

    def _state(self) -> Store:
        if self._store is None:
            self._store = connect(self.settings.redis_url, self.settings.namespace)
        return self._store

    def _abort(self, room: int, reason: str) -> None:
        """Fail the room for both sides (its prefill frees the blocks on its next step).
        Bounded by the store's call timeout; a failure is logged, and the prefill's
        timeouts stay the backstop."""
        try:
            self._state().abort(room, reason)
        except KVStateError as exc:
            log.warning("room %s: abort (%s) failed: %s", room, reason, exc)

    def _judge(self, params: dict[str, Any]) -> tuple[KVFacts | None, str]:
        """The prefill's facts and why this engine cannot take its pages ('' if it
        can), remembered per prefill engine and facts (a few entries: one per prefill
        configuration seen)."""
        assert self.facts is not None
        remote = str(params.get("remote_engine_id"))
        raw = params.get("kvstate_kv")
        try:
            key: tuple[Any, ...] = (remote, *sorted(raw.items())) if isinstance(raw, dict) else ()
            hash(key)
        except TypeError:  # a value that is not hashable: judged each time
            key = ()
        verdict = self._judged.get(key) if key else None
        if verdict is None:
            theirs = KVFacts.from_params(raw)
            verdict = (theirs, refusal(remote, theirs, self.engine, self.facts))
            if key and len(self._judged) < 256:
                self._judged[key] = verdict
        return verdict

    def _refusal(self, params: dict[str, Any]) -> str:
        """Why this engine cannot take the prefill's pages ('' if it can)."""
        return self._judge(params)[1]

    def _fall_back(self, request: Any, remote: str, why: str) -> None:
        """A request computed here because its KV cannot come: counted, and a WARNING
        the first time a prefill engine sends one for that reason."""
        self.stats.record("num_recompute_fallbacks")
        if (remote, why) not in self._warned:
            self._warned.add((remote, why))
            log.warning(
                "decode %s computes requests from prefill %s itself (first: %s): %s",
                self.engine,
                remote,
                request.request_id,
                why,
            )

    def _traced(self, request: Any) -> None:
        """Keep the request's trace context (its ``traceparent`` header, if a valid one)
        for this step's workers: a traced room links to the serving request's trace."""
        headers = getattr(request, "trace_headers", None)
        if not headers:  # most requests: no trace context
            return
        found = next((v for k, v in headers.items() if str(k).lower() == "traceparent"), None)
        context = traceparent(found)
        if context is not None:
            self._traces[request.request_id] = context

    # -- decode ---------------------------------------------------------------------
    @staticmethod
    def _remote(request: Any) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("kvstate_room") is not None:
            return dict(params)
        return None

    @property
    def backoff(self) -> int:
        """Prompt tokens the decode computes itself after a load: 1 with a Mamba state
        (its state after the prompt's last token is computed there, from the state
        before it; vLLM recomputes the last loaded token, which a state cannot take
        twice), else 0 (vLLM recomputes that token's KV, which is idempotent)."""
        return 1 if self.facts is not None and self.facts.stateful else 0

    def on_new_request(self, request: Any) -> None:
        """A decode request to load from a prefill waits in the queue: hold its room.
        A prefill request of a stateful engine stops one token short (``backoff``), as
        NixlConnector does, so that its state is the one the decode continues from."""
        params = None if self.producer else self._remote(request)
        if params is not None:
            self._queued[request.request_id] = int(params["kvstate_room"])
        if (
            self.producer
            and self.backoff
            and (request.kv_transfer_params or {}).get("do_remote_decode")
        ):
            truncate(request, self.backoff, self.hash_block_size)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The whole uncached prompt, loaded asynchronously; nothing when the prefill's
        pages would not fit this engine (the request then computes its prompt here)."""
        params = self._remote(request)
        if params is None or self._refusal(params):
            return 0, False
        count = len(request.prompt_token_ids or ()) - self.backoff - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = self._remote(request)
        if params is None:
            return
        self._queued.pop(request.request_id, None)
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request
        room = int(params["kvstate_room"])
        remote = str(params["remote_engine_id"])
        if num_external_tokens <= 0:
            why = self._refusal(params)
            if why:
                self._fall_back(request, remote, why)
            else:
                why = "decode has the whole prompt cached"
                log.info("request %s: not loading room %s: %s", request.request_id, room, why)
            self._abort(room, f"request {request.request_id} loads nothing: {why}")
            return
        facts = self._judge(params)[0]
        assert facts is not None  # _refusal accepted them
        ids, why = self._pages(blocks, params.get("kvstate_blocks"))
        if why:  # the blocks are allocated: the load fails (vLLM's failure policy)
            ids = [b for group in blocks.get_unhashed_block_ids_all_groups() for b in group]
            self._abort(room, f"request {request.request_id}: {why}")
        self._recv[request.request_id] = Load(room, remote, facts, ids, why)
        self._traced(request)
        self._loading[request.request_id] = room

    def _pages(self, blocks: Any, counts: object) -> tuple[list[int], str]:
        """The decode's blocks to load, every KV cache group's after the other
        (groups.py): the last ``min(m, n_g)`` of group g's new blocks, n_g the
        prefill's count, m this engine's new blocks per attention group. ('', why)
        if this engine's blocks cannot line up with the prefill's."""
        per_group = blocks.get_unhashed_block_ids_all_groups()
        try:
            lists = [g.clip(per_group[i]) for g, i in zip(self.groups, self.transfer, strict=True)]
        except LayoutRefusedError as exc:
            return [], str(exc)
        if not (
            isinstance(counts, list)
            and len(counts) == len(lists)
            and all(isinstance(n, int) and n >= 0 for n in counts)
        ):
            return [], f"the prefill's block counts {counts!r} are not {len(lists)} counts"
        m = max(len(ids) for ids in lists)
        take = wanted(counts, m)
        short = any(len(ids) < n for ids, n in zip(lists, take, strict=True))
        # a full-attention group reads every new block: each must come from the prefill
        if short or any(
            g.kind == "full" and len(ids) != n
            for g, ids, n in zip(self.groups, lists, take, strict=True)
        ):
            return [], (
                f"the prefill kept {counts} blocks of its KV cache groups "
                f"({'; '.join(g.spec for g in self.groups)}), this decode needs "
                f"{[len(ids) for ids in lists]} of them (every block of a full-attention "
                "group): the two engines' groups do not line up"
            )
        return flatten(lists, take), ""

    def _decode_finished(self, request: Any) -> None:
        """A decode request that ends before its load concluded (an abort) fails its
        room, so the prefill frees its blocks: through the workers' receivers when they
        have one (a load that concluded meanwhile is left alone), else from here."""
        rid = request.request_id
        self._queued.pop(rid, None)
        why = f"request {rid} ended on decode engine {self.engine}"
        room = self._loading.pop(rid, None)
        if room is not None and self._recv.pop(rid, None) is None:
            self._aborts[rid] = why  # its workers hold receivers
            return
        if room is None and self._remote(request) is not None:
            room = int(request.kv_transfer_params["kvstate_room"])  # never scheduled
        if room is not None:
            self._abort(room, why)

    def _hold(self) -> None:
        """Renew the holds of the queued requests' rooms (at most every HOLD_EVERY s)."""
        now = time.monotonic()
        if not self._queued or now - self._held_at < HOLD_EVERY:
            return
        self._held_at = now
        try:
            self._state().hold_many(self._queued.values(), HOLD_FOR)
        except KVStateError as exc:  # the prefill's bootstrap timeout stays the bound
            log.warning("%s: holding queued rooms failed: %s", self.engine, exc)

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads the workers concluded leave the pending set."""
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    # -- both -------------------------------------------------------------------
    def build_connector_meta(self) -> KVStateConnectorMetadata:
        self._hold()
        meta = KVStateConnectorMetadata(
            recv=self._recv, send=self._send, abort=self._aborts, traces=self._traces
        )
        self._recv, self._send, self._aborts, self._traces = {}, {}, {}, {}
        return meta

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished_all_groups (its hybrid KV cache manager's hook): one
        block list per KV cache group."""
        params = request.kv_transfer_params or {}
        if not self.producer:
            self._decode_finished(request)
            return False, None
        if not params.get("do_remote_decode") or not any(block_ids):
            return False, None
        if request.status not in HANDED_OVER:
            return False, None  # aborted (or failed) on prefill: nothing to hand over
        assert self._facts_params is not None
        try:
            kept = [g.clip(block_ids[i]) for g, i in zip(self.groups, self.transfer, strict=True)]
        except LayoutRefusedError as exc:  # nothing handed over: the decode computes it
            log.warning("request %s: not handed to a decode: %s", request.request_id, exc)
            return False, None
        nonce = new_nonce()
        room = room_of(self.engine_id, request.request_id, nonce)
        self._send[request.request_id] = (room, kept)
        self._traced(request)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvstate_room": room,
            "kvstate_nonce": nonce,
            "remote_engine_id": self.engine,
            "kvstate_kv": dict(self._facts_params),
            "kvstate_blocks": [len(ids) for ids in kept],
        }

    def get_stats(self) -> KVStateConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def truncate(request: Any, n: int, hash_block_size: int) -> None:
    """Drop the prompt's last ``n`` tokens from a prefill request (it then computes the
    state the decode continues from), once, with its block hashes; vLLM's Request has
    no public call for it, NixlConnector edits it the same way."""
    params = request.kv_transfer_params
    prompt = request.prompt_token_ids
    if params.get("kvstate_truncated") or prompt is None or len(prompt) <= n:
        return
    del prompt[-n:]
    tokens = request._all_token_ids
    if tokens is not prompt:
        del tokens[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1
    request.truncate_block_hashes(hash_block_size)
    params["kvstate_truncated"] = True


__all__ = ["KVStateConnectorMetadata", "Load", "SchedulerSide", "truncate"]
