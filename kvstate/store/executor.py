"""Execution: a batch of calls in one round trip per node.

On a standalone server a batch is one round trip; on a Cluster it is one round trip
per node (a transaction: one MULTI/EXEC per slot in it), sent straight to the node
that owns the keys, the nodes at once. Every round trip takes the lean path of
``kvstate.store.wire`` (one packed write, one hiredis read loop). Scripts run by FCALL
of the library (``kvstate.store.functions``) on a node where it was verified to hold
kvstate's exact code, else by EVALSHA (``kvstate.store.scripts``), decided per node; a
batch that met a reply saying the way was wrong for its node (NOSCRIPT, "Function not
found", FCALL unknown or refused) is sent again another way, never surfacing that
reply.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError, RedisClusterException, ResponseError

from kvstate.errors import CorruptStateError, DurabilityError, KVStateError, StateConnectionError
from kvstate.store import functions, notices, scripts, wire
from kvstate.store.calls import Call
from kvstate.store.connection import Client
from kvstate.store.deadline import time_left
from kvstate.store.translate import NODE_TROUBLE, Translating

_MULTI = wire.pack(("MULTI",))
_EXEC = wire.pack(("EXEC",))
# FUNCTION LOAD, then FUNCTION LIST of the library with its code: whether the node may
# run FCALL from the next batch on (functions.verified), never for the batch they ride
# with (its FCALLs would run before the check: a library of that name loaded by
# someone else first could answer anything)
_PROBE = [
    wire.pack(("FUNCTION", "LOAD", functions.LIBRARY)),
    wire.pack(functions.LIST),
]
# How a batch runs its scripts (Executor._retry picks the next): FCALL of the library's
# functions; EVALSHA; EVAL of the sources; EVAL of the sources behind the probe (after
# "Function not found", or NOSCRIPT: a new server may run FCALL, the probe tells).
FCALL, EVALSHA, EVAL, PROBE_EVAL = "fcall", "evalsha", "eval", "probe"


def _way_error(exc: object) -> bool:
    """An error that ``Executor._retry`` may answer by sending the batch another way."""
    return (
        scripts.is_noscript(exc)
        or functions.not_found(exc)
        or functions.refused(exc)
        or isinstance(exc, OutOfMemoryError)
    )


class Executor(Translating):
    """The execution side of ``Store``: where its round trips go and how."""

    client: Client
    cluster: bool
    _pool: ThreadPoolExecutor | None  # Cluster: one pipeline per node at once
    _pool_pid: int
    _pool_lock: threading.Lock
    _fcall: dict[object, bool]  # node -> whether it runs the scripts by FCALL (unknown: probe)
    eval_only = False  # the EVAL path on any server (tests, tools/bench_state.py --eval)

    @property
    def fcall_by_node(self) -> dict[object, bool]:
        """How each node met so far runs kvstate's scripts: True by FCALL (its library
        verified to hold kvstate's exact code), False by EVALSHA/EVAL (a Redis 6.2, a
        user without FUNCTION, a library not verified); a node not met yet is absent."""
        return dict(self._fcall)

    def nodes(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every primary: where SCAN, SCRIPT LOAD, INFO and CONFIG go."""
        if self.closed:
            raise self.closed_error()
        if not self.cluster:
            return [(self.url, self.client)]  # type: ignore[list-item]
        with self.errors():
            primaries = self.client.get_primaries()  # type: ignore[union-attr]
        return [(n.name, n.redis_connection) for n in primaries]

    def execute(
        self, calls: Sequence[Call], transaction: bool = False, partial: bool = False
    ) -> list[Any]:
        """Run ``calls`` in as few round trips as the deployment allows; parsed replies.

        Within ``options.call_timeout``. With ``partial``, a call that met corrupt state
        gets its CorruptStateError *in its place*, and (Cluster) calls on a node that
        cannot be reached get a StateConnectionError, instead of failing the batch (a
        corrupt room fails alone); the batch still raises when no node answered.
        """
        if not calls:
            return []
        try:
            with self.bounded():
                if self.cluster:
                    raw = self._execute_cluster(calls, transaction, partial)
                else:
                    raw = self._execute_on(self.client, list(calls), transaction, partial)  # type: ignore[arg-type]
        finally:
            notices.told_here(calls)  # it may have run even where it raised
        return [
            reply if isinstance(reply, KVStateError) else call.parse(reply)
            for call, reply in zip(calls, raw, strict=True)
        ]

    def _execute_on(
        self, conn: redis.Redis, calls: list[Call], transaction: bool, partial: bool = False
    ) -> list[Any]:
        """One round trip to one server (kvstate.store.wire): the batch packed into one write,
        the replies read in one loop. ``transaction`` (or a call's ``atomic``): the
        calls in MULTI/EXEC, one block per hash slot on a Cluster (so a node's slots
        still share the trip), after the batch's other calls.
        Scripts run by FCALL where the node's library was verified, else by EVALSHA
        (EVAL behind the probe on a node not decided yet: ``_retry``); a reply
        that the way is wrong for the node (``_retry``) sends the batch again another
        way: every batch is safe to send twice.
        Durable mode: a batch holding a DURABLE_SCRIPTS call ends with WAIT, in the
        same write, and is answered only when a replica confirmed it. ``partial``: a
        call's CorruptStateError takes its reply's place instead of raising."""
        blocks = self._blocks(calls, transaction)
        inside = {i for block in blocks for i in block}
        bare = [i for i in range(len(calls)) if i not in inside]
        durable = self.options.durable and any(c.script in scripts.DURABLE_SCRIPTS for c in calls)
        node = functions.node_key(conn)
        way = self._fcall.get(node)  # None: not decided yet (probe it, by EVAL meanwhile)
        how = EVALSHA if self.eval_only or way is False else FCALL if way else PROBE_EVAL
        if how == PROBE_EVAL and not any(c.script for c in calls):
            how = EVALSHA  # no script in the batch: nothing to decide (nor to run) yet
        for attempt in range(3):
            packed = [self._pack(call, how) for call in calls]
            out: list[bytes] = [packed[i] for i in bare]
            for block in blocks:
                out.append(_MULTI)
                out += [packed[i] for i in block]
                out.append(_EXEC)
            load = how == PROBE_EVAL
            if load:
                out = [*_PROBE, *out]
            if durable:
                wait_s = self._wait_budget()
                out = [*out, wire.pack(("WAIT", 1, int(wait_s * 1000)))]
            raw = wire.roundtrip(conn, b"".join(out), len(out))
            confirmed = raw.pop() if durable else None
            listed = raw[1] if load else None
            if load:
                del raw[:2]
            replies: list[Any] = [None] * len(calls)
            for i, reply in zip(bare, raw, strict=False):
                replies[i] = reply
            at = len(bare)
            for block in blocks:
                retry = attempt < 2
                self._unblock(calls, block, raw[at : at + len(block) + 2], replies, retry)
                at += len(block) + 2
            again = self._retry(node, how, listed, replies, not blocks)
            if again is not None and attempt < 2:
                how = again
                continue
            callbacks: Any = conn.response_callbacks
            for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
                if isinstance(reply, Exception):
                    err = self.reply_error(call, reply)
                    if partial and isinstance(err, CorruptStateError):
                        replies[i] = err
                        continue
                    raise err
                if call.command is not None:
                    callback = callbacks.get(call.command)
                    if callback is not None:
                        replies[i] = callback(reply)
            if durable:
                self._check_confirmed(confirmed, calls, wait_s)
            return replies
        raise AssertionError("unreachable")

    def _retry(
        self, node: object, how: str, listed: object, replies: list[Any], oom_retry: bool
    ) -> str | None:
        """How to send the batch again, or None (the replies stand). FCALL: the node
        lacks the library -> EVAL of the sources behind the probe (FUNCTION LOAD, then
        FUNCTION LIST WITHCODE), whose answer decides the next batches; it cannot run
        FCALL (Redis 6.2, renamed, the ACL) -> the EVAL path from now on; refused up
        front at maxmemory (outside MULTI, where EVAL would be refused too) -> EVAL,
        whose reads go through. EVALSHA after NOSCRIPT (a restarted or new server) ->
        the same probe and EVAL, which cannot meet NOSCRIPT. The probe's batch itself
        always runs by EVAL: FCALL only once the node's library was verified."""
        errors = [r for r in replies if isinstance(r, Exception)]
        if how == PROBE_EVAL:
            self._fcall[node] = not self.eval_only and functions.verified(listed)
            return None
        if how == EVALSHA:
            if not any(scripts.is_noscript(r) for r in errors):
                return None
            return EVAL if self.eval_only else PROBE_EVAL
        if how != FCALL:
            return None
        if any(functions.refused(r) for r in errors):
            self._fcall[node] = False
            return EVAL
        if any(functions.not_found(r) for r in errors):
            self._fcall[node] = False  # until the probe verifies the library again
            return PROBE_EVAL
        if oom_retry and any(isinstance(r, OutOfMemoryError) for r in errors):
            return EVAL
        return None

    def _wait_budget(self) -> float:
        """Seconds WAIT may block for: what is left of the call, and no more than one
        socket wait (its reply is read in one), less a margin for the reply to come
        back (Redis answered a timed-out WAIT 15-25 ms late on an idle host here, more
        on a busy one); never under 1 ms (WAIT 0 would block for ever)."""
        left = min(time_left() or 0.0, self.options.socket_timeout)
        return max(0.001, left - max(0.25, left * 0.2))

    def _check_confirmed(self, confirmed: Any, calls: list[Call], wait_s: float) -> None:
        """Raise unless WAIT says a replica has the batch (and all before it)."""
        if isinstance(confirmed, Exception):  # NOPERM (+wait missing), or a replica
            raise self.reply_error(Call((), (), command="WAIT"), confirmed)
        if isinstance(confirmed, int) and confirmed >= 1:
            return
        done = ", ".join(sorted({c.script or "" for c in calls} & scripts.DURABLE_SCRIPTS))
        raise DurabilityError(
            f"Redis at {self.url} ran {done}, but no replica confirmed it within "
            f"{wait_s:.2f} s (WAIT answered {confirmed!r}): durability not confirmed, and a "
            "failover of that primary could lose the write. Check that the primary has a "
            "live replica (INFO replication), then call again: the call is idempotent"
        )

    def _blocks(self, calls: list[Call], transaction: bool) -> list[list[int]]:
        """Indices of the calls in MULTI/EXEC (all with ``transaction``, else the
        ``atomic`` ones), per block: one block on a standalone server, one per hash slot
        (in order of first appearance) on a Cluster; [] when none is."""
        inside = [i for i, call in enumerate(calls) if transaction or call.atomic]
        if not self.cluster or not inside:
            return [inside] if inside else []
        keyslot = self.client.keyslot  # type: ignore[union-attr]
        slots: dict[int, list[int]] = {}
        for i in inside:
            slots.setdefault(keyslot(calls[i].keys[0]), []).append(i)
        return list(slots.values())

    def _unblock(
        self, calls: list[Call], block: list[int], raw: list[Any], replies: list[Any], retry: bool
    ) -> None:
        """The replies of one MULTI/EXEC block into ``replies``, as redis-py's pipeline
        reads them: a command refused when queued (OOM, NOPERM...) aborts the block,
        which raises that error for the block's first call; with ``retry``, an error
        that the batch goes again another way for (``_retry``) is left in its place."""
        queued = [r for r in raw[:-1] if isinstance(r, Exception)]
        result = raw[-1]
        if isinstance(result, Exception) or result is None:
            exc = queued[0] if queued else result
            if exc is None:
                exc = ResponseError("EXEC answered nil: the transaction was discarded")
            if retry and _way_error(exc):
                replies[block[0]] = exc  # _retry sends the batch again
                return
            raise self.reply_error(calls[block[0]], exc) from None
        if len(result) != len(block):
            raise ResponseError("wrong number of replies in a transaction")
        for i, reply in zip(block, result, strict=True):
            replies[i] = reply

    @staticmethod
    def _pack(call: Call, how: str) -> bytes:
        if call.script is None:
            name = call.command or ""
            head = name.split() if " " in name else (name,)
            return wire.pack((*head, *call.keys, *call.args))
        if how == FCALL:
            script: tuple[Any, ...] = functions.invocation(call.script)
        else:
            script = scripts.invocation(call.script, how != EVALSHA)
        return wire.pack((*script, len(call.keys), *call.keys, *call.args))

    def _execute_cluster(
        self, calls: Sequence[Call], transaction: bool, partial: bool
    ) -> list[Any]:
        """One round trip per node (a transaction: one MULTI/EXEC per slot in it), the
        nodes at once; calls that met a redirect or an unreachable node are retried
        after a topology refresh, ``options.retries`` times within the call's deadline."""
        replies: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        cluster: Any = self.client  # a RedisCluster (its API is untyped)
        trouble: dict[int, tuple[str, BaseException]] = {}  # call -> (node, last error)
        for attempt in range(self.options.retries + 1):
            groups: dict[str, list[int]] = {}  # per node (per slot inside it: _blocks())
            for i in pending:
                node = cluster.get_node_from_key(calls[i].keys[0])
                groups.setdefault(node.name, []).append(i)
            outcomes = self._run_groups(
                [
                    (cluster.get_node(node_name=name).redis_connection, [calls[i] for i in idxs])
                    for name, idxs in groups.items()
                ],
                transaction,
                partial,
            )
            failed: list[int] = []
            for (name, idxs), out in zip(groups.items(), outcomes, strict=True):
                if isinstance(out, DurabilityError) and partial:  # ran: never sent again
                    unconfirmed = DurabilityError(f"Cluster node {name}: {out}")
                    for i in idxs:
                        replies[i] = unconfirmed
                    continue
                if isinstance(out, BaseException):
                    if not isinstance(out, NODE_TROUBLE):
                        raise out
                    failed += idxs
                    trouble.update(dict.fromkeys(idxs, (name, out)))
                    continue
                for i, reply in zip(idxs, out, strict=True):
                    replies[i] = reply
            pending = failed
            pause = 0.1 * (attempt + 1)
            left = time_left()
            if (
                not failed
                or attempt == self.options.retries
                or (left is not None and left <= pause)
            ):
                break
            time.sleep(pause)
            # no node answering CLUSTER SLOTS just now is fine: the next attempt tells
            with contextlib.suppress(
                RedisClusterException, redis.ConnectionError, redis.TimeoutError
            ):
                cluster.nodes_manager.initialize()
        if pending:
            if not partial or len(pending) == len(calls):
                raise trouble[pending[0]][1]
            said: dict[int, StateConnectionError] = {}  # one error object per node error
            for i in pending:
                name, exc = trouble[i]
                if id(exc) not in said:
                    better = self.translate_error(exc)
                    said[id(exc)] = StateConnectionError(f"Cluster node {name}: {better}")
                    said[id(exc)].may_have_run = getattr(better, "may_have_run", False)
                replies[i] = said[id(exc)]
        return replies

    def _run_groups(
        self,
        groups: list[tuple[redis.Redis, list[Call]]],
        transaction: bool,
        partial: bool = False,
    ) -> list[list[Any] | BaseException]:
        """Each group's replies, or what it raised; the groups run at once (one thread
        per node), each under the caller's deadline, so a stalled node costs the others
        nothing."""

        def run(conn: redis.Redis, batch: list[Call]) -> list[Any] | BaseException:
            try:
                return self._execute_on(conn, batch, transaction, partial)
            except Exception as exc:  # noqa: BLE001 - sorted out by the caller
                return exc

        if len(groups) == 1:
            return [run(*groups[0])]
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():  # none, or a fork's
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvstate-node")
                self._pool_pid = os.getpid()
            pool = self._pool
        ctx = contextvars.copy_context()
        futures = [pool.submit(ctx.copy().run, run, conn, batch) for conn, batch in groups]
        return [f.result() for f in futures]
