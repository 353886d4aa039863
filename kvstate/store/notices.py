"""An engine's change notices as they arrive (docs/design.md, "Change notices"): one
subscription, on a connection of its own, to ``Keys.changed(engine)``, read without
waiting. Here because it is redis-py's PubSub; ``kvstate.roles.notices`` decides what a
step polls from what it answers."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Sequence

import redis

from kvstate.keys import Keys, check_room
from kvstate.store.calls import Call

log = logging.getLogger(__name__)

# what drain() answers when it cannot name the rooms that changed: poll them all
EVERYTHING = None
RETRY_S = 1.0  # between subscribe attempts that failed
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
    """A subscription to one channel of room ids. ``drain()`` answers the rooms named
    since its last call, or EVERYTHING where notices may have been lost: until the
    first subscribe confirmation, at each later one (redis-py subscribes again after a
    reconnect, silently: what was published meanwhile is gone), after any error, and
    once closed. It never waits on the network: a read finds what has arrived."""

    def __init__(self, client: redis.Redis, keys: Keys, engine: str) -> None:
        self.keys, self.engine, self.channel = keys, engine, keys.changed(engine)
        self._client = client  # its own pool: closed with the feed
        self._lock = threading.Lock()  # told_here may run on a heartbeat's thread
        self._here: set[int] = set()
        self.closed = False
        self._confirmed = False
        self._sub: redis.client.PubSub | None = None
        self._retry_at = 0.0  # monotonic: no subscribe attempt before it
        _FEEDS.add(self)

    def start(self) -> None:
        """Subscribe now (the manager, once registered, within one call's time); a
        drain subscribes if this did not, or failed."""
        self._subscribe()

    def _subscribe(self) -> None:
        """Subscribe, in the caller's call and deadline (design rule 10). One that
        fails is tried again by a drain RETRY_S later (Redis down: the step's polls say
        so, each step)."""
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            sub: redis.client.PubSub = self._client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            sub.subscribe(self.channel)  # the confirmation is read by drain()
            self._sub = sub
        except Exception as exc:  # a hint only: never fail a step for it
            self._retry_at = now + RETRY_S
            log.info("change notices off for now (%s): every step polls every room", exc)

    def tell(self, room: int) -> None:
        """A room changed by a call of this process (``told_here``)."""
        with self._lock:
            self._here.add(room)

    def drain(self) -> set[int] | None:
        """The rooms named since the last call; EVERYTHING (None) when notices may have
        been lost since, or the feed is not (yet, or any more) subscribed."""
        if self._sub is None and not self.closed:
            self._subscribe()
        if self.closed or self._sub is None:
            return EVERYTHING
        with self._lock:
            rooms, self._here = self._here, set()
        everything = not self._confirmed
        try:
            while True:
                msg = self._sub.get_message(timeout=0.0)
                if msg is None:
                    break
                kind = msg.get("type")
                if kind == "message":
                    rooms.add(_room(msg["data"]))
                elif kind == "subscribe":
                    self._confirmed = everything = True
                elif kind == "unsubscribe":
                    self._confirmed, everything = False, True
        except Exception as exc:  # redis-py's errors, a bad notice, a PubSub left unset
            log.info("change notices on %s interrupted (%s): polling every room", self.channel, exc)
            self._confirmed = False  # the next confirmation says it is back
            return EVERYTHING
        return EVERYTHING if everything else rooms

    def close(self) -> None:
        """Unsubscribe and drop the connection; a broken one is closed quietly."""
        self.closed = True
        _FEEDS.discard(self)
        if self._sub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self._sub.close()
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.connection_pool.disconnect()


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
