"""Calls built apart from their execution: what to send, never sending it.

A ``Call`` is one command or script invocation with how to read its reply. ``Calls``
(mixed into ``Store``) builds every call kvstate makes about room state, from the
namespace's key names, the room TTL and the trace settings; no method here does I/O.
Roles batch the calls they build and hand them to ``Store.execute``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvstate import schema
from kvstate.defaults import BOOTSTRAP_TIMEOUT
from kvstate.errors import CorruptStateError, InvalidArgumentError
from kvstate.keys import Keys, Side
from kvstate.poll import KVPoll
from kvstate.store.connection import Options
from kvstate.trace import context_entry, sampled

# s: the shortest life of a room's failure mark (docs/design.md, Data model): a
# participant joining late waits at most its bootstrap timeout, 300 s by default
MARK_MIN_TTL = max(300.0, BOOTSTRAP_TIMEOUT)


@dataclass(frozen=True)
class Status:
    """A script's answer about one participant; ``status`` None means it does not exist."""

    status: KVPoll | None
    reason: str
    infos: dict[str, bytes] = field(default_factory=dict)
    version: int = -1  # of the infos (poll.lua); -1 when none came back
    # a publish.lua lookup's: the listed senders the receiver is bound to after it
    # (engine -> incarnation) and the senders required; None when the call made no
    # lookup or stopped before binding (receiver missing, Failed or Success)
    bound: dict[str, str] | None = None
    required: int = 0

    @classmethod
    def parse(cls, raw: Any) -> Status:
        name = raw[0].decode()
        reason = raw[1].decode("utf-8", "replace")
        infos: dict[str, bytes] = {}
        if len(raw) > 2:
            flat = raw[2]
            infos = {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}
        version = int(raw[3]) if len(raw) > 3 else -1
        status = KVPoll[name] if name else None
        return cls(status, "" if not name else reason, infos, version)

    @classmethod
    def parse_bound(cls, raw: Any) -> Status:
        """A publish.lua lookup's answer: {status, reason}, or, once it bound or found
        bound, {status, reason, {engine, incarnation, ...}, senders required}."""
        if len(raw) < 4:
            return cls.parse(raw)
        flat = raw[2]
        bound = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        return replace(cls.parse(raw[:2]), bound=bound, required=int(raw[3]))


def _identity(raw: Any) -> Any:
    return raw


@dataclass(frozen=True)
class Call:
    """One command or script invocation, with how to read its reply. ``atomic``: it runs
    in one MULTI/EXEC with the batch's other atomic calls of its hash slot, the rest of
    the batch beside it in the same round trip (a step's clears riding its poll)."""

    keys: tuple[str, ...]
    args: tuple[Any, ...]
    script: str | None = None
    command: str | None = None
    parse: Callable[[Any], Any] = _identity
    atomic: bool = False


def command_call(
    name: str, *keys: str, args: Iterable[Any] = (), parse: Callable[[Any], Any] = _identity
) -> Call:
    """One Redis command as a Call: what every feature module builds its reads and
    writes with (the registry, the ledger, the stats, the operator views), to run in
    ``Store.execute`` beside others in one round trip."""
    return Call(tuple(keys), tuple(args), command=name, parse=parse)


def script_call(
    name: str,
    keys: Iterable[str],
    args: Iterable[Any],
    parse: Callable[[Any], Any] = _identity,
) -> Call:
    """One of kvstate's Lua scripts (``kvstate/scripts/<name>.lua``) as a Call, without
    a room trace (the room scripts' calls, which carry one, are ``Calls``')."""
    return Call(tuple(keys), tuple(args), script=name, parse=parse)


class Calls:
    """The room calls of ``Store``: pure functions of the namespace and options."""

    keys: Keys
    room_ttl: float
    options: Options

    @property
    def ttl_ms(self) -> int:
        return int(self.room_ttl * 1000)

    @property
    def mark_ttl_ms(self) -> int:
        """The TTL of a room's failure mark: it must outlive any participant that can
        still join the room (a late one waits up to its bootstrap timeout), so at least
        the room TTL and ``MARK_MIN_TTL`` (the default bootstrap timeout)."""
        return max(self.ttl_ms, int(MARK_MIN_TTL * 1000))

    def _script(
        self,
        name: str,
        keys: Iterable[str],
        args: Iterable[Any],
        parse: Callable[[Any], Any] = _identity,
        room: int | None = None,
        follow: bool = False,
    ) -> Call:
        """A script call; with ``room``, the trace argument appended at the end of its
        arguments and, unless it is 0 (not traced), the room's trace key at the end of
        its keys (``_lib.lua``'s take_trace: an untraced call carries no trace key)."""
        if room is None:
            return script_call(name, keys, args, parse)
        arg = self.trace_arg(room, follow)
        if arg:
            keys = (*keys, self.keys.trace(room))
        return Call(tuple(keys), (*args, arg), script=name, parse=parse)

    def traced(self, room: int) -> bool:
        """Whether this store traces ``room`` (``Options.trace_rate``, by room id)."""
        return sampled(room, self.options.trace_rate)

    def trace_arg(self, room: int, follow: bool = False) -> int:
        """The scripts' trace argument: the trace TTL in ms when this store traces the
        room, else 0 (nothing written) or, with ``follow``, minus the TTL: append only
        to a trace that exists (an abort of a room someone else traces)."""
        ttl = int(self.options.trace_ttl * 1000)
        if self.traced(room):
            return ttl
        return -ttl if follow else 0

    _command = staticmethod(command_call)

    # -- participant calls ----------------------------------------------------------
    def _room_keys(self, room: int, side: Side, engine: str) -> list[str]:
        """The KEYS every room script starts with: the participant, the room hash, the
        room's failure mark."""
        k = self.keys
        return [k.participant(room, side, engine), k.room_hash(room), k.aborted(room)]

    def create(self, room: int, side: Side, engine: str, fields: dict[str, Any]) -> Call:
        if schema.PEERS in fields:  # what create.lua reads back (schema.MAX_PEERS)
            schema.check_count(fields[schema.PEERS], "the peers of a participant")
        return self._script(
            "create",
            self._room_keys(room, side, engine),
            [self.ttl_ms, schema.member(side, engine), *pairs(fields)],
            Status.parse,
            room,
        )

    def poll(
        self,
        room: int,
        side: Side,
        engine: str,
        with_infos: bool = False,
        infos_version: int = -1,
        declared: int = 0,
        begin: bool = False,
    ) -> Call:
        """Poll one participant; ``with_infos``: a sender's transfer infos too, unless
        they are still at ``infos_version`` (the version the caller holds).
        ``declared``: the receivers a sender without a count of its own learned from
        its infos (poll.lua writes it and may move the sender to WaitingForInput).
        ``begin`` (a sender's, with its infos): a sender found ready is begun in the
        same call, as ``begin`` would (poll.lua)."""
        keys = self._room_keys(room, side, engine)
        args: list[Any] = [self.ttl_ms, infos_version, self.mark_ttl_ms]
        if with_infos:
            args.append(engine)
            if declared or begin:  # what poll.lua writes as the sender's peers
                args.append(schema.check_count(declared, "the receivers declared"))
            if begin:
                args.append(self.keys.participant(room, "rx", ""))
        return self._script("poll", keys, args, Status.parse, room)

    def update(self, room: int, side: Side, engine: str, status: KVPoll, reason: str = "") -> Call:
        check_reason(reason)
        keys = self._room_keys(room, side, engine)
        return self._script(
            "update",
            keys,
            [KVPoll.parse(status).name, reason, self.ttl_ms, self.mark_ttl_ms],
            Status.parse,
            room,
        )

    def publish(
        self,
        room: int,
        receiver: str,
        senders: dict[str, str],
        payload: bytes = b"",
        required: int = 0,
        lookup: str | None = None,
        want: int = 0,
        payloads: dict[str, bytes] | None = None,
        named: Iterable[str] = (),
    ) -> Call:
        """Bind a receiver to ``senders`` (engine -> incarnation) and, given a payload,
        publish it to them (``payloads``: a sender's own, else ``payload``); ``want``:
        the receivers each of them waits for, as the receivers declare it (0: none
        declared); see publish.lua. ``lookup`` (a bootstrap address; a
        standalone server only, where the index shares the script): the script finds
        the senders to bind in that address's engine index itself (only those
        ``named``, if any) and answers whom it is bound to (``Status.bound``);
        ``senders`` are then those the caller knows bound, which it publishes to
        itself."""
        k = self.keys
        schema.check_count(required, "the senders a receiver requires")
        schema.check_count(want, "the receivers declared for each sender")
        keys = self._room_keys(room, "rx", receiver)
        args: list[Any] = [self.ttl_ms, receiver, payload, required, self.mark_ttl_ms]
        own = payloads or {}
        if lookup is not None:
            keys.append(k.engines_at(lookup))
            only = list(named)
            args += [k.participant(room, "tx", ""), want, len(only)]
            for sender in only:
                args += [sender, own.get(sender, b"")]
            args += list(senders)
            return self._script("publish", keys, args, Status.parse_bound, room)
        args += ["", want]  # no lookup: the senders follow
        for sender, incarnation in senders.items():
            keys.append(k.participant(room, "tx", sender))
            args += [sender, incarnation, own.get(sender, b"")]
        return self._script("publish", keys, args, Status.parse, room)

    def begin(self, room: int, sender: str, receivers: Iterable[str]) -> Call:
        k = self.keys
        names = list(receivers)
        keys = self._room_keys(room, "tx", sender)
        keys += [k.participant(room, "rx", r) for r in names]
        args = [self.ttl_ms, self.mark_ttl_ms, "", *names]
        return self._script("begin", keys, args, Status.parse, room)

    def finish(self, room: int, sender: str, receivers: Iterable[str]) -> Call:
        k = self.keys
        names = list(receivers)
        keys = self._room_keys(room, "tx", sender)
        keys += [k.participant(room, "rx", receiver) for receiver in names]
        args = [self.ttl_ms, sender, self.mark_ttl_ms, *names]
        return self._script("finish", keys, args, Status.parse, room)

    def track(self, bootstrap_addr: str, room: int, receiver: str) -> Call:
        member = self.keys.tracker_member(room, receiver)
        key = self.keys.tracker(bootstrap_addr, room)
        return self._script("track", [key], [member, self.ttl_ms])

    def clear_calls(
        self,
        room: int,
        side: Side,
        engine: str,
        senders: Iterable[str] = (),
        peer_addr: str | None = None,
        receivers: Iterable[str] = (),
    ) -> list[Call]:
        """What deletes everything one participant created (see ``clear_many``): its hash
        and its room-hash fields: its member, the infos it read (a sender: ``receivers``)
        or published (a receiver: to ``senders``), a receiver's acks."""
        k = self.keys
        me = k.participant(room, side, engine)
        fields = [schema.member(side, engine), schema.HOLD]  # a hold goes with the room
        if side == "tx":
            fields += [schema.xfer_field(engine, r) for r in receivers]
        else:
            fields.append(schema.ack_field(engine))
            fields += [schema.xfer_field(s, engine) for s in senders]
        calls = [
            # the room's failure mark stays: a participant joining later must see it
            self._command("DEL", me),
            self._command("HDEL", k.room_hash(room), args=fields),
        ]
        if self.traced(room):  # in the room's MULTI/EXEC: no round trip of its own
            calls.append(self._trace_cleared(room, me))
        if peer_addr is not None:
            member = k.tracker_member(room, engine)
            calls.append(self._command("ZREM", k.tracker(peer_addr, room), args=[member]))
        return calls

    def _trace_cleared(self, room: int, participant: str) -> Call:
        """trace.lua: the ``cleared`` entry of a traced room, appended only to a trace
        that exists (a participant that never ran a script starts none). The trace is
        not deleted with the room: it outlives it by ``Options.trace_ttl``."""
        ttl = int(self.options.trace_ttl * 1000)
        return Call((participant, self.keys.trace(room)), (-ttl,), script="trace")

    def abort_call(self, room: int, reason: str, members: list[str]) -> Call:
        """abort.lua over the room's participants as the caller read them (``members``:
        ``member_fields``); it answers -1 when they changed since (read them again)."""
        k = self.keys
        keys = [k.room_hash(room), k.aborted(room)]
        for member in members:
            part = schema.parse_member(member)
            if part is None:
                raise CorruptStateError(k.room_hash(room), member, "not a tx:/rx: member")
            keys.append(k.participant(room, *part))
        args = [self.ttl_ms, reason, self.mark_ttl_ms, *members]
        return self._script("abort", keys, args, room=room, follow=True)

    def hold(self, room: int, ms: int) -> Call:
        """hold.lua: a decode engine holds ``room`` queued for ``ms`` more (answers 1;
        0 when the room does not exist): its senders' bootstrap timeout waits."""
        return self._script("hold", [self.keys.room_hash(room)], [ms])

    def fail_receiver(self, key: str, peer_engine: str, incarnation: str, reason: str) -> Call:
        """Fail one receiver (by key) if it is bound to that peer (and incarnation)."""
        parsed = self.keys.parse_room_key(key)
        if parsed is None or parsed.side != "rx":
            raise CorruptStateError(key, "*", "not a receiver participant key")
        return self._script(
            "fail_bound",
            [key, self.keys.room_hash(parsed.room), self.keys.aborted(parsed.room)],
            [self.ttl_ms, reason, peer_engine, incarnation, self.mark_ttl_ms],
            room=parsed.room,
        )

    def trace_context(self, room: int, side: Side, engine: str, context: str) -> Call:
        """Append a serving request's trace context to the room's trace, only to a trace
        that exists (RPUSHX: never creates a key, design rule 1): a plain command sent
        in the participant's create batch, after its create, so no round trip of its
        own (the room's slot). ``context`` is a checked ``traceparent``."""
        entry = context_entry(side, engine, context)
        return self._command("RPUSHX", self.keys.trace(room), args=[entry])


def member_fields(raw: Iterable[bytes]) -> list[str]:
    """The participant fields of a room hash's HKEYS reply, sorted: its transfer
    infos, acks and hold left out."""
    fields = (m.decode("utf-8", "replace") for m in raw)
    return sorted(f for f in fields if not f.startswith(schema.ROOM_DATA))


def pairs(fields: dict[str, Any]) -> list[Any]:
    """A hash's fields as HSET (and the scripts) take them: name, value, name, value..."""
    return [x for item in fields.items() for x in item]


def text_or_none(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def check_reason(reason: object) -> None:
    if not isinstance(reason, str):
        raise InvalidArgumentError(f"a failure reason must be text (str), got {reason!r}")
