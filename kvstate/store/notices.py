"""An engine's change notices as they arrive (docs/design.md, "Change notices"): one
subscription, on a connection of its own, to ``Keys.changed(engine)``, read by a
thread so that a step takes them without waiting or a system call. Here because it is
redis-py's PubSub; ``kvstate.roles.notices`` decides what a step polls from what it
answers."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis

from kvstate.keys import Keys, check_room
from kvstate.store.calls import Call

log = logging.getLogger(__name__)

# what drain() answers when it cannot name the rooms that changed: poll them all
EVERYTHING = None
RETRY_S = 1.0  # between subscribe (or read) attempts that failed
READ_S = 0.25  # the reader's longest wait on the socket: how soon it sees a close
# the scripts that notify (_lib.lua's notify): also told to this process's own feeds
NOTIFYING = frozenset({"publish", "finish", "abort", "fail_bound", "update", "begin"})
_FEEDS: weakref.WeakSet[ChangeFeed] = weakref.WeakSet()


def told_here(calls: Sequence[Call]) -> None:
    """A batch with notifying scripts ran (or may have) in this process: its rooms go
    to this process's feeds at once, but the caller's own engine's. A PUBLISH may reach
    a subscriber after the caller has its reply (Redis writes both in one pass, in
    any order): without this, a step right after another engine's call in the same
    process (a test, the demo, one process holding both sides) could miss it."""
    if not _FEEDS:
        return
    feeds = list(_FEEDS)
    for call in calls:
        if call.script not in NOTIFYING or not call.keys:
            continue
        for feed in feeds:
            key = feed.keys.parse_room_key(call.keys[0])  # None: another namespace's
            if key is not None and not (key.side and key.rest == feed.engine):
                feed.tell(key.room)


class ChangeFeed:
    """A subscription to one channel of room ids, read by a thread of its own as
    notices arrive, so that a step's ``drain()`` only takes what was gathered: no
    network, no system call. ``drain()`` answers the rooms named since its last call,
    or EVERYTHING where notices may have been lost: until the first subscribe
    confirmation, at each later one (redis-py subscribes again after a reconnect,
    silently: what was published meanwhile is gone), after any error, and once
    closed."""

    def __init__(self, client: redis.Redis, keys: Keys, engine: str) -> None:
        self.keys, self.engine, self.channel = keys, engine, keys.changed(engine)
        self._client = client  # its own pool: closed with the feed
        self._lock = threading.Lock()  # the reader, told_here's callers and drain()
        self._rooms: set[int] = set()  # named since the last drain
        self._confirmed = False  # subscribed, and nothing lost since the confirmation
        self._lost = False  # a notice may have been lost since the last drain
        self.closed = False
        self._stop = threading.Event()
        self._sub: redis.client.PubSub | None = None
        self._reader: threading.Thread | None = None
        _FEEDS.add(self)

    def start(self) -> None:
        """Subscribe now, in the caller's call and deadline (the manager, once
        registered: the first steps need not wait for a thread), then read on a thread,
        which subscribes again every RETRY_S where this failed (Redis down: the step's
        polls say so, each step). A drain starts a feed not started."""
        if self._reader is not None or self.closed:
            return
        self._subscribe()
        self._reader = threading.Thread(
            target=_read,
            args=(weakref.ref(self), self._client),
            name=f"kvstate-notices-{self.engine}",
        )
        self._reader.daemon = True  # never holds up the interpreter's exit
        self._reader.start()

    def _subscribe(self) -> None:
        try:
            sub: redis.client.PubSub = self._client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            sub.subscribe(self.channel)  # the confirmation is read by the reader
            self._sub = sub
        except Exception as exc:  # a hint only: never fail a step for it
            log.info("change notices off for now (%s): every step polls every room", exc)

    def _take(self, msg: dict[str, Any]) -> None:
        """One message the reader got: a notice, or a (un)subscribe confirmation."""
        kind = msg.get("type")
        if kind == "message":
            room = _room(msg["data"])
            with self._lock:
                self._rooms.add(room)
        elif kind in ("subscribe", "unsubscribe"):
            with self._lock:
                self._confirmed, self._lost = kind == "subscribe", True

    def _trouble(self, exc: Exception, malformed: bool) -> None:
        """What the reader met instead of a message: everything is polled, and after
        an error of the connection, until the next subscribe confirmation."""
        log.info("change notices on %s interrupted (%s): polling every room", self.channel, exc)
        with self._lock:
            self._lost = True
            if not malformed:
                self._confirmed = False

    def tell(self, room: int) -> None:
        """A room changed by a call of this process (``told_here``)."""
        with self._lock:
            self._rooms.add(room)

    def drain(self) -> set[int] | None:
        """The rooms named since the last call; EVERYTHING (None) when notices may have
        been lost since, or the feed is not (yet, or any more) subscribed."""
        if self._reader is None:
            self.start()
        with self._lock:
            rooms, self._rooms = self._rooms, set()
            lost, self._lost = self._lost, False
            if self.closed or lost or not self._confirmed:
                return EVERYTHING
        return rooms

    def quiet(self) -> bool:
        """Subscribed, and no room named nor notice lost since the last ``drain``: a
        drain now would answer no room. Drains nothing."""
        with self._lock:
            return self._reader is not None and not (
                self._rooms or self._lost or self.closed or not self._confirmed
            )

    def close(self) -> None:
        """Stop the reader without waiting for it: within READ_S it closes the
        subscription and drops the connection itself (a connection closed under its
        read would be opened again by redis-py's retry, and subscribed again)."""
        self.closed = True
        self._stop.set()
        _FEEDS.discard(self)
        if self._reader is None:
            _disconnect(self._sub, self._client)


def _read(ref: weakref.ref[ChangeFeed], client: redis.Redis) -> None:
    """A feed's reader thread. It holds the feed weakly and not while it waits (in
    ``select``, without the GIL), so a feed nobody closed ends with its last reference;
    either way the reader closes the subscription and the feed's pool as it ends."""
    sub: redis.client.PubSub | None = None
    try:
        while (feed := ref()) is not None and not feed.closed:
            sub, stop = feed._sub, feed._stop
            if sub is None:
                feed._subscribe()
                del feed
                stop.wait(RETRY_S)
                continue
            del feed
            error: Exception | None = None
            try:
                msg = sub.get_message(timeout=READ_S)
                if msg is not None and (feed := ref()) is not None and not feed.closed:
                    feed._take(msg)
            except Exception as exc:  # redis-py's errors, a notice that names no room
                error = exc
            feed = ref()
            if error is None or feed is None or feed.closed:
                continue
            malformed = isinstance(error, ValueError)
            feed._trouble(error, malformed)
            del feed
            if not malformed:  # redis-py reconnects, and subscribes, at the next read
                stop.wait(RETRY_S)
    finally:
        feed = ref()
        if feed is not None and feed._sub is not None:
            sub = feed._sub  # subscribed on this thread since the last look
        del feed
        _disconnect(sub, client)


def _disconnect(sub: redis.client.PubSub | None, client: redis.Redis) -> None:
    """Close a subscription and its feed's pool; a broken one quietly."""
    if sub is not None:
        with contextlib.suppress(Exception):
            sub.close()
    with contextlib.suppress(Exception):
        client.connection_pool.disconnect()


def _room(data: object) -> int:
    """A notice's room id; anything else raises ValueError (then everything is polled)."""
    text = data.decode() if isinstance(data, bytes) else str(data)
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"not a room id: {text[:64]!r}")
    try:
        return check_room(int(text))
    except Exception as exc:
        raise ValueError(str(exc)) from None


__all__ = ["EVERYTHING", "NOTIFYING", "ChangeFeed", "told_here"]
