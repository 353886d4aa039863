"""The UCX path: endpoints to receivers, their remote keys, puts, flush and the wait.

Runs on the UCX thread (``transports.ucx.runtime``): the ctypes calls must be
made on the thread that progresses the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time

from transports.base import TransportError
from transports.ucx.abi import UCS_INPROGRESS, RequestParam, ptr_status
from transports.ucx.plan import Peer, Plan
from transports.ucx.runtime import Runtime

# UCX names the symptom (Endpoint timeout, Connection reset...), not the cause
_PEER_HINT = " (peer dead or unreachable?)"


class Puts:
    """One transport's endpoints and remote keys, and its writes by ``ucp_put_nbx``."""

    def __init__(self, rt: Runtime, error_handling: bool) -> None:
        self._rt = rt
        self._lib = rt.lib
        self._error_handling = error_handling
        self._peers: dict[bytes, Peer] = {}

    async def _peer(self, endpoint: bytes, name: str) -> Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            ucxx = self._rt.ucxx
            try:
                address = ucxx.get_ucx_address_from_buffer(endpoint)
                ep = await ucxx.create_endpoint_from_worker_address(
                    address, endpoint_error_handling=self._error_handling
                )
            except Exception as exc:  # ucxx raises its own exception types
                raise TransportError(f"cannot reach {name}: {exc}") from exc
            raced = self._peers.get(endpoint)
            if raced is not None:  # a concurrent write connected first: use its endpoint
                with contextlib.suppress(Exception):
                    ep.abort()
                return raced
            peer = Peer(name, ep, int(ep.ucp_endpoint))
            self._peers[endpoint] = peer
        return peer

    def _rkey(self, peer: Peer, packed: bytes) -> int:
        rkey = peer.rkeys.get(packed)
        if rkey is None:
            handle = ctypes.c_void_p()
            self._lib.check(
                self._lib.ep_rkey_unpack(peer.ep_h, packed, ctypes.byref(handle)),
                f"unpacking the remote key of {peer.name}",
            )
            rkey = handle.value or 0
            peer.rkeys[packed] = rkey
        return rkey

    def _drop_peer(self, endpoint: bytes) -> None:
        """Forget a peer after a failure so the next write reconnects from scratch."""
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        for rkey in peer.rkeys.values():
            self._lib.rkey_destroy(rkey)
        peer.rkeys.clear()
        with contextlib.suppress(Exception):
            peer.ep.abort()

    async def write_each(self, plans: list[Plan], deadline: float) -> dict[bytes, str]:
        """``write`` to each receiver of ``plans`` at once (its plans together): the
        receivers whose write failed, with why; the others' bytes still land."""
        by_receiver: dict[bytes, list[Plan]] = {}
        for p in plans:
            by_receiver.setdefault(p.endpoint, []).append(p)
        done = await asyncio.gather(
            *(self.write(group, deadline) for group in by_receiver.values()),
            return_exceptions=True,
        )
        failed = {}
        for endpoint, outcome in zip(by_receiver, done, strict=True):
            if isinstance(outcome, TransportError):
                failed[endpoint] = str(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        return failed

    async def write(self, plans: list[Plan], deadline: float) -> None:
        """Put every run of ``plans`` and flush each receiver once, after the puts of its
        last plan in a row (a flush completes once every put before it on its endpoint
        has); return at remote completion. Errors name the receiver; the caller names
        the rooms."""
        lib = self._lib
        put, flush_nbx = lib.put_nbx, lib.ep_flush_nbx
        flush_param = RequestParam()
        pending: list[tuple[int, Plan]] = []
        try:
            for i, plan in enumerate(plans):
                peer = await self._peer(plan.endpoint, plan.name)
                rkeys = [self._rkey(peer, packed) for packed in plan.rkeys]
                ep_h = peer.ep_h
                for region, rkey, (laddrs, raddrs, sizes) in zip(
                    plan.regions, rkeys, plan.ops, strict=True
                ):
                    param = ctypes.byref(region.param)
                    for laddr, raddr, size in zip(laddrs, raddrs, sizes, strict=True):
                        ptr = put(ep_h, laddr, size, raddr, rkey, param)
                        if ptr:
                            status = ptr_status(ptr)
                            if status < 0:
                                raise TransportError(
                                    f"put to {plan.name} failed: "
                                    f"{lib.status_string(status)}{_PEER_HINT}"
                                )
                            pending.append((ptr, plan))
                if i + 1 < len(plans) and plans[i + 1].endpoint == plan.endpoint:
                    continue  # the same receiver's next plan: one flush after all
                # Remote completion of every put above, in one request per receiver.
                ptr = flush_nbx(ep_h, ctypes.byref(flush_param))
                status = ptr_status(ptr)
                if status < 0:
                    raise TransportError(
                        f"flush to {plan.name} failed: {lib.status_string(status)}{_PEER_HINT}"
                    )
                if status == UCS_INPROGRESS:
                    pending.append((ptr or 0, plan))
            await self._wait(pending, deadline)
        except BaseException as exc:
            for ptr, _ in pending:
                lib.request_free(ptr)
            failed = (
                {p.endpoint for _, p in pending}
                if isinstance(exc, TimeoutError)
                else {p.endpoint for p in plans}
            )
            for endpoint in failed:
                self._drop_peer(endpoint)
            if isinstance(exc, TimeoutError):
                names = sorted({p.name for _, p in pending})
                raise TransportError(
                    f"deadline exceeded with {len(pending)} operations to "
                    f"{', '.join(names)} unfinished (peer dead or unreachable?)"
                ) from None
            raise

    async def _wait(self, pending: list[tuple[int, Plan]], deadline: float) -> None:
        """Progress the worker until every request completes; TimeoutError at the deadline.

        Only the last request to each receiver (its flush) is polled while waiting:
        polling hundreds of puts per progress call cost more than the copies. Those
        are found again only after a sweep, not on every spin.
        Completed requests are removed from ``pending`` in place, so the caller
        frees only what is still outstanding.
        """
        lib, worker = self._lib, self._rt.worker
        check = lib.request_check_status
        spins = 0
        # Found once per sweep, not per spin: with 64 KiB puts a write leaves ~1000
        # requests pending and spins ~200 times (counted here), so walking them on
        # every spin was ~200,000 Python steps per 64 MiB write.
        lasts = self._lasts(pending)
        while pending:
            worker.progress()
            if all(check(ptr) != UCS_INPROGRESS for ptr in lasts):
                keep, error = [], None
                for ptr, plan in pending:
                    status = check(ptr)
                    if status == UCS_INPROGRESS:
                        keep.append((ptr, plan))
                        continue
                    lib.request_free(ptr)
                    if status < 0 and error is None:
                        error = (
                            f"transfer to {plan.name} failed: "
                            f"{lib.status_string(status)}{_PEER_HINT}"
                        )
                pending[:] = keep
                if error is not None:
                    raise TransportError(error)
                if not pending:
                    return
                lasts = self._lasts(pending)
            if time.monotonic() >= deadline:
                raise TimeoutError
            spins += 1
            # Spin briefly (transfers finish in micro- to milliseconds), then back off.
            await asyncio.sleep(0 if spins < 200 else 0.0005)

    @staticmethod
    def _lasts(pending: list[tuple[int, Plan]]) -> list[int]:
        """The last outstanding request to each receiver (the flush, when it is pending)."""
        last: dict[bytes, int] = {}
        for ptr, plan in pending:
            last[plan.endpoint] = ptr
        return list(last.values())

    def close(self) -> None:
        """Destroy every remote key and endpoint (on the UCX thread)."""
        for endpoint in list(self._peers):
            self._drop_peer(endpoint)
