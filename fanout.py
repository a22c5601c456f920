"""SSE fan-out: one greenlet per stream writes each new event to every caught-up subscriber.

Left to themselves, 10,000 SSE subscribers of one stream mean 10,000 greenlets woken
for every event, each switched in (gevent copies its C stack back), checking the stream,
looking its event up and writing it through pywsgi: in py-spy the switch alone was 28 %
of that work, and an event took 0.5–1 s to reach the last subscriber. Here a subscriber
at the tail hands its connection to the stream's broadcaster (`Fanout.follow`), which
builds each event once per cursor and writes it straight to every socket, without
blocking and without switching into anyone's greenlet.

The broadcaster writes only while the subscriber's own greenlet is parked in `follow`,
between the response's own writes, framed as the response frames them, so the two
never interleave. It hands the connection back when the subscriber's time is up (the
long-poll timeout, after which the view sends its periodic control event, or the SSE's
maximum duration), when the kernel does not take a whole event at once (the rest goes
out from the subscriber's greenlet, which can wait for the socket to drain), when the
connection fails, when the stream closes, and when the broadcaster meets an error (the
subscriber's next wait meets it too, and ends the response as before), and when the
worker stops (wakeups.py's `end_waits`: the subscriber then sends its last event).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import gevent
from gevent.event import Event

from objectstore import StorageUnavailable
from storage import StreamStore
from streams import StoreError, StreamInfo
from wakeups import Alarms, WaitsEnded

log = logging.getLogger("picomq.fanout")

DIRECT_WRITER_ENVIRON_KEY = "picomq.direct_writer"

# (path, stream info, offset, cursor, base64 data?) -> (end offset, the SSE event's bytes)
EventMaker = Callable[[str, StreamInfo, int, str, bool], tuple[int, bytes]]


class DirectWriter(Protocol):
    """The connection of a streaming response, as the server offers it (worker.py)."""

    chunked: bool  # whether the response's body goes out in chunked transfer coding

    def send_now(self, data: bytes) -> int:
        """Send what the kernel takes without waiting; OSError if the connection is gone."""

    def send_rest(self, data: bytes) -> None:
        """Send all of `data`, waiting for the socket to drain."""


@dataclass(eq=False, slots=True)
class Follower:
    """A subscriber parked at the tail, and what the broadcaster did for it."""

    writer: DirectWriter
    incarnation: str  # of the stream it follows: events never come from another
    offset: int
    cursor: str
    base64_data: bool
    chunked: bool  # the writer's, asked once
    handed_back: Event = field(default_factory=Event)
    unsent: bytes = b""  # the part of the last event the kernel did not take
    failed: bool = False  # the connection is gone
    closed: bool = False  # the stream's closing event was sent
    timed_out: bool = False  # handed back because its time was up


@dataclass(eq=False, slots=True)
class _Broadcast:
    incarnation: str  # the stream's: a broadcast ends with it
    offset: int  # where every follower is
    followers: dict[Follower, None] = field(default_factory=dict)  # insertion-ordered set


class Fanout:
    """The broadcasters of one process, one per stream that has followers."""

    def __init__(
        self,
        store: StreamStore,
        make_event: EventMaker,
        advance_cursor: Callable[[str], str],
        wait_seconds: float,
    ) -> None:
        self._store = store
        self._make_event = make_event
        self._advance_cursor = advance_cursor
        self._wait_seconds = wait_seconds
        self._broadcasts: dict[str, _Broadcast] = {}
        self._alarms = Alarms()

    def follow(self, path: str, follower: Follower, timeout: float) -> bool:
        """Park `follower` with the stream's broadcaster until handed back or `timeout`.

        False, at once, if the broadcaster is elsewhere in the stream (it moved on while
        this subscriber wrote its last event) or on another incarnation of it (one
        deleted, whose broadcaster has not ended yet): the subscriber goes on by itself.
        """
        broadcast = self._broadcasts.get(path)
        if broadcast is None:
            broadcast = self._broadcasts[path] = _Broadcast(follower.incarnation, follower.offset)
            gevent.spawn(self._broadcast, path, broadcast)
        if (broadcast.incarnation, broadcast.offset) != (follower.incarnation, follower.offset):
            return False
        broadcast.followers[follower] = None
        time_up = functools.partial(_time_up, broadcast, follower)
        self._alarms.at(time.monotonic() + timeout, time_up)
        try:
            follower.handed_back.wait()
        finally:
            broadcast.followers.pop(follower, None)
        return True

    def _broadcast(self, path: str, broadcast: _Broadcast) -> None:
        try:
            while broadcast.followers:
                info = self._store.wait(
                    path, broadcast.offset, self._wait_seconds, incarnation=broadcast.incarnation
                )
                if info.tail > broadcast.offset or info.closed:
                    self._deliver(path, info, broadcast)
                    if info.closed and broadcast.offset == info.tail:
                        break
        except (StoreError, StorageUnavailable, WaitsEnded) as error:
            log.info("fan-out on %s ended: %s", path, error)
        finally:
            if self._broadcasts.get(path) is broadcast:
                del self._broadcasts[path]
            for follower in list(broadcast.followers):
                _hand_back(broadcast, follower)

    def _deliver(self, path: str, info: StreamInfo, broadcast: _Broadcast) -> None:
        """Build the event once per (cursor, encoding, framing), then write it to each.

        Building may wait on storage, and meanwhile followers may come and go; writing
        never waits, so the followers written to are exactly those parked right then.
        """
        known = {follower.cursor for follower in broadcast.followers}
        cursors = {cursor: self._advance_cursor(cursor) for cursor in known}
        kinds = {
            (cursors[follower.cursor], follower.base64_data, follower.chunked)
            for follower in broadcast.followers
        }
        end = broadcast.offset  # where every kind of event ends: only the cursor differs
        events: dict[tuple[str, bool, bool], bytes] = {}
        for cursor, base64_data, chunked in kinds:
            end, event = self._make_event(path, info, broadcast.offset, cursor, base64_data)
            events[cursor, base64_data, chunked] = frame(event, chunked)
        if not events:
            return
        closed = info.closed and end == info.tail
        for follower in list(broadcast.followers):
            cursor = cursors.get(follower.cursor, "")
            framed = events.get((cursor, follower.base64_data, follower.chunked))
            if framed is None:  # it came while the events were built: it catches up itself
                _hand_back(broadcast, follower)
                continue
            try:
                sent = follower.writer.send_now(framed)
            except OSError:
                follower.failed = True
                _hand_back(broadcast, follower)
                continue
            follower.offset, follower.cursor, follower.closed = end, cursor, closed
            if sent < len(framed):
                follower.unsent = framed[sent:]
                _hand_back(broadcast, follower)
        broadcast.offset = end


def frame(data: bytes, chunked: bool) -> bytes:
    """`data` as one piece of a response body, as pywsgi frames what an app yields."""
    return b"%x\r\n%b\r\n" % (len(data), data) if chunked else data


def _time_up(broadcast: _Broadcast, follower: Follower) -> None:
    if follower in broadcast.followers:
        follower.timed_out = True
        _hand_back(broadcast, follower)


def _hand_back(broadcast: _Broadcast, follower: Follower) -> None:
    broadcast.followers.pop(follower, None)
    follower.handed_back.set()
