"""SGLang's sender, receiver and bootstrap server on kvstate's roles."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvstate.errors import KVStateError, PeerNotFoundError
from kvstate.integrations.sglang.base import BaseReceiver, BaseSender, BaseServer, conn
from kvstate.integrations.sglang.manager import Adapter, KVStateKVManager
from kvstate.integrations.sglang.ranks import prefill_engine
from kvstate.integrations.sglang.shape import plan, refusal, state_refusal, writes_slots
from kvstate.integrations.sglang.slots import COUNTED, pack, unpack
from kvstate.integrations.sglang.spaces import Spaces
from kvstate.poll import KVPoll
from kvstate.roles import KVReceiver, KVSender
from transports.base import Heads, TransportError

log = logging.getLogger(__name__)


def decode_engine(receiver: str) -> str:
    """A decode receiver's engine less its TP rank: one request's receivers share it."""
    return receiver.rsplit("/tp", 1)[0]


class KVStateKVSender(Adapter, BaseSender):
    """Prefill side of one room."""

    def __init__(
        self,
        mgr: KVStateKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self._aux: int | None = None
        self._num_pages: int | None = None
        self._sent = 0
        self._bytes = 0
        self._latency = 0.0
        if self._admitted:
            self._guard("creating the sender", self._create)

    def _create(self) -> None:
        # as many decode ranks as they declare (kvstate.tp: TP sizes may differ)
        self._part = self.kv_mgr.kv.sender(self.bootstrap_room, required_receivers=None)

    def poll(self) -> KVPoll:
        if self._part is None or self._local_reason:
            return self._polled(self._status)
        st = self._polled(self.kv_mgr.poll_room(self))
        if st in (KVPoll.WaitingForInput, KVPoll.Transferring):
            assert isinstance(self._part, KVSender)
            infos = self._part.published
            if len({decode_engine(r) for r in infos}) > 1:
                # a second decode request published into this room (sglang#40125)
                with self._lock:
                    self._guard(
                        "duplicate",
                        lambda: self._part.abort(  # type: ignore[union-attr]
                            f"duplicate bootstrap_room {self.bootstrap_room}: {len(infos)} decode "
                            f"receivers ({', '.join(sorted(infos))}) published into one room; "
                            "refused, not shared"
                        ),
                    )
                return self._polled(KVPoll.Failed)
        return st

    def pop_decode_prefix_len(self) -> int:
        if self._part is None or self._local_reason:
            return 0
        with self._lock:
            try:
                return int(self._part.prefix_len)  # type: ignore[union-attr]
            except KVStateError as exc:
                self._fail_local(f"reading the decode prefix failed: {exc}")
                return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # the last chunk carries aux and state and concludes the room, pages or not
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        with self._lock:
            self._num_pages = int(num_kv_indices)
            self._aux = aux_index
            if self._part is not None:
                self._guard("init", lambda: self._part.init(num_kv_indices))  # type: ignore[union-attr]

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Move this chunk's pages; with the last chunk also the aux slot and the state
        slots, and only then conclude the room (the receiver's Success means all landed)."""
        with self._lock:
            if self._part is None or self._local_reason:
                return
            pages = np.asarray(kv_indices)
            total = self._sent + int(pages.size)
            last = self._num_pages is not None and total >= self._num_pages
            spaces = self.kv_mgr.spaces
            if spaces is None:
                raise KVStateError("send() in mirror mode: the mirrored backend moves the bytes")
            t0 = time.perf_counter()
            before = spaces.stats.bytes_moved
            part = self._part
            assert isinstance(part, KVSender)
            ok = True

            def move() -> None:
                nonlocal ok
                ok = part.send(pages, last=False) == KVPoll.Transferring
                if ok and last:
                    self._send_slots(part, state_indices)
                    part.finish_transfer()

            self._guard("send", move)
            self._sent = total
            self._latency += time.perf_counter() - t0
            self._bytes += spaces.stats.bytes_moved - before

    def _send_slots(self, part: KVSender, state_indices: list[Any] | None) -> None:
        spaces = self.kv_mgr.spaces
        if not isinstance(spaces, Spaces):
            return
        timeout = self.kv_mgr.kv.transfer_timeout
        room = self.bootstrap_room
        state = [
            (i, np.asarray(s, dtype=np.int64).reshape(-1))
            for i, s in enumerate(state_indices or [])
            if s is not None
        ]
        # the metadata (aux) is the last pipeline stage's output
        last_stage = self.kv_mgr.pp_rank == self.kv_mgr.pp_size - 1
        for info in part.transfer_infos().values():
            if info.dummy or not last_stage:
                continue
            whole = writes_slots(info.heads, info.dummy)
            peer = self.kv_mgr.kv.peer(info.receiver, info.incarnation)
            # before any slot moves, each type's count against the decode's: a window of
            # another length is refused (Mooncake cuts both lists to the shorter, whose
            # pages need not be the same positions)
            counted = bool(peer.layout.get(COUNTED))
            dsts = unpack(info.state_indices, counted, state, room, info.receiver)
            if whole and self._aux is not None and info.aux_index is not None:
                spaces.write_space(
                    spaces.aux,
                    peer.layout.get("aux"),
                    "the aux slot",
                    room,
                    peer.endpoint,
                    np.array([self._aux]),
                    np.array([info.aux_index]),
                    timeout,
                )
            remote = peer.layout.get("state") or []
            heads = None if info.heads is None else Heads(*info.heads)
            for (i, src), dst in zip(state, dsts, strict=True):
                sliced = i < len(spaces.state_heads) and spaces.state_heads[i] > 0
                if heads is not None and not sliced:
                    # a heads route (TP sizes differ): the decode refuses this first
                    # (state_refusal); never move a whole slot that holds other heads
                    # than the receiver's. No heads: the one sender (whole) moves slots
                    raise TransportError(
                        f"room {room}: state type {i} moves between equal TP sizes only"
                    )
                spaces.write_space(
                    spaces.state[i] if i < len(spaces.state) else None,
                    remote[i] if i < len(remote) else None,
                    f"state type {i}",
                    room,
                    peer.endpoint,
                    src,
                    dst,
                    timeout,
                    heads,
                )

    def mirror(self, theirs: int, backend: str) -> KVPoll:
        """Mirror mode: record what the other backend's sender reports and answer
        Failed when kvstate has the room Failed (an abort from anywhere)."""
        ours = self.poll()
        part = self._part
        if ours == KVPoll.Failed or not isinstance(part, KVSender):
            return KVPoll.Failed
        with self._lock:
            if theirs == KVPoll.Failed:
                self._guard(
                    "recording the failure",
                    lambda: part.fail(f"{backend} reported the transfer failed"),
                )
                return KVPoll.Failed
            if theirs == KVPoll.Success and ours != KVPoll.Success:
                self.mirror_begin()
                if part.status == KVPoll.Transferring:
                    self._guard("finish_transfer", part.finish_transfer)
        return KVPoll(int(theirs))

    def mirror_begin(self) -> None:
        """Mirror mode: the other backend starts moving pages (Transferring, once)."""
        with self._lock:
            part = self._part
            if isinstance(part, KVSender) and part.status == KVPoll.WaitingForInput:
                self._guard("begin_transfer", part.begin_transfer)

    def get_transfer_metric(self) -> Any:
        return conn.KVTransferMetric(
            transfer_latency_s=self._latency, transfer_total_bytes=self._bytes
        )

    def mark_prefill_complete(self) -> None:
        """Nothing to publish early: decode allocates before prefill runs."""

    def abort(self) -> None:
        self._abort("prefill")


class KVStateKVReceiver(Adapter, BaseReceiver):
    """Decode side of one room. SGLang's WaitingForInput means "handshake done, send
    the metadata"; kvstate's means "metadata published": the adapter reports
    WaitingForInput after ``init()`` until ``send_metadata()``, then Transferring
    until the sender concluded."""

    def __init__(
        self, mgr: KVStateKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._metadata_sent = False
        self.prefill_tp = mgr.tp_size

    def init(self, prefill_dp_rank: int) -> None:
        with self._lock:
            if self._local_reason or self._part is not None:
                return
            mgr = self.kv_mgr
            addr = self.bootstrap_addr
            info = mgr.prefill_info_table.get(addr)
            prefill_tp = info.tp_size if info is not None else mgr.tp_size
            self.prefill_tp = prefill_tp
            why = refusal(addr, prefill_tp, info.page_heads if info else None, mgr.shape)
            if why:
                mgr.refused(addr, why)
                self._fail_local(why)
                return
            dp = int(prefill_dp_rank or 0)
            pp = info.pp_size if info is not None else 1
            p = plan(
                lambda r, stage: prefill_engine(addr, dp, r, stage, pp),
                prefill_tp,
                pp,
                mgr.shape,
                mgr.tp_rank,
            )
            try:
                self._part = mgr.kv.receiver(
                    self.bootstrap_room,
                    addr,
                    senders=p.senders,
                    receivers_per_sender=p.per_sender,
                )
            except PeerNotFoundError as exc:
                self._fail_local(str(exc))
            except KVStateError as exc:
                self._fail_local(f"binding to {', '.join(p.senders)} failed: {exc}")

    def poll(self) -> KVPoll:
        if self._part is None or self._local_reason:
            return self._polled(self._status)
        st = self.kv_mgr.poll_room(self)
        if st in (KVPoll.Failed, KVPoll.Success):
            return self._polled(st)
        self._status = st
        return KVPoll.Transferring if self._metadata_sent else KVPoll.WaitingForInput

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        with self._lock:
            if self._part is None or self._local_reason:
                return
            if getattr(destination, "value", destination) == "host":
                self._fail_local("host KV destinations are not supported by kvstate's backend")
                return
            # each type's count first (slots.pack), where this side's spaces move them;
            # mirror mode publishes the flat list it always did
            parts = [np.asarray(s).reshape(-1) for s in state_indices or [] if s is not None]
            flat = np.concatenate(parts) if parts else None
            state = pack(state_indices) if isinstance(self.kv_mgr.spaces, Spaces) else flat
            kinds = [
                i for i, s in enumerate(state_indices or []) if s is not None and np.asarray(s).size
            ]
            mgr = self.kv_mgr
            why = state_refusal(mgr.kv_args, mgr.shape, self.bootstrap_addr, self.prefill_tp, kinds)
            if why:
                self.kv_mgr.refused(self.bootstrap_addr, why)
                self._guard("send_metadata", lambda: self._part.abort(why))  # type: ignore[union-attr]
                self._fail_local(why)
                return
            part = self._part
            assert isinstance(part, KVReceiver)
            self._guard(
                "send_metadata",
                lambda: part.init(
                    kv_indices, aux_index, state, prefix_len=int(decode_prefix_len or 0)
                ),
            )
            self._metadata_sent = True

    def queued(self) -> bool:
        return self._part is not None and not self._metadata_sent and not self._local_reason

    def abort(self) -> None:
        self._abort("decode")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The abort is in Redis already; the prefill learns it on its next poll."""

    def mirror(self, theirs: int, backend: str) -> KVPoll:
        """Mirror mode: the other backend's status unless kvstate has the room Failed
        (a prefill abort, a lost prefill lease, ``kvstate abort``)."""
        ours = self.poll()
        if ours == KVPoll.Failed:
            return KVPoll.Failed
        if theirs == KVPoll.Failed and self._part is not None:
            part = self._part
            with self._lock:
                self._guard(
                    "recording the failure",
                    lambda: part.fail(f"{backend} reported the transfer failed"),
                )
            return KVPoll.Failed
        return KVPoll(int(theirs))


class KVStateBootstrapServer(BaseServer):
    """Stands where SGLang starts its bootstrap HTTP server: kvstate needs none
    (engines register in Redis with a lease), so this only says so."""

    def __init__(self, host: str, port: int, **_: Any) -> None:
        self.host = host
        self.port = port
        log.info(
            "kvstate backend: no bootstrap server on %s:%s; prefill ranks register "
            "in kvstate's registry",
            host,
            port,
        )

    def close(self) -> None:
        """Nothing to stop."""
