"""Live reads: the SSE responses (framing, events, the loop that feeds each one), the
fan-out that writes one event to every subscriber at a stream's tail, and the count of
the live connections a worker holds. Long-poll is a view of picomq.py, on `live_wait`
and `LiveConnections` from here.

The fan-out: one greenlet per stream writes each new event to every caught-up subscriber.

Left to themselves, 10,000 SSE subscribers of one stream mean 10,000 greenlets woken
for every event, each switched in (gevent copies its C stack back), checking the stream,
looking its event up and writing it through pywsgi: the switches alone were a large part
of that work, and the last subscribers got each event late (figures: bench/README.md).
Here a subscriber at the tail hands its connection to the stream's broadcaster
(`Fanout.follow`), which builds each event once per cursor and writes it straight to
every socket, without blocking and without switching into anyone's greenlet.

The fan-out is an accelerator: it needs a server that offers its connection (worker.py),
and without one every response writes its own events, the reference path, complete on
its own. tests/test_fanout.py holds what subscribers get through the fan-out to that:
every event once, in order, framed as the response frames it, a control event each
long-poll timeout, an end when the stream is closed or deleted.

The broadcaster writes only while the subscriber's own greenlet is parked in `follow`,
between the response's own writes, framed as the response frames them, so the two
never interleave. It hands the connection back when the subscriber's time is up (the
long-poll timeout, after which the response sends its periodic control event, or the
SSE's maximum duration), when the kernel does not take a whole event at once (the rest goes
out from the subscriber's greenlet, which can wait for the socket to drain), when the
connection fails, when the stream closes, and when the broadcaster meets an error (the
subscriber's next wait meets it too, and ends the response as before), and when the
worker stops (wakeups.py's `end_waits`: the subscriber then sends its last event).

A live read may also be ended early by another greenlet (`LiveRead.end`: auth.py does,
when its token is revoked): as the stop does, at the read's wait, but without a last
event, and a long-poll answers 401 instead of 204.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import gevent
import orjson
from gevent.event import Event

from objectstore import ObjectCache, StorageUnavailable
from protocol import SSE_DATA_ENCODING, Response, advanced_cursor, format_offset
from settings import Settings
from storage import StreamStore
from streams import ReadResult, StoreError, StreamInfo, is_json_type
from wakeups import Alarms, WaitsEnded, waits_ended

if TYPE_CHECKING:
    from prometheus_client import Gauge

log = logging.getLogger("picomq.live")

SSE_CACHE_BYTES = 32 * 1024 * 1024  # formatted SSE event pairs shared by subscribers

# (path, stream info, offset, cursor, base64 data?) -> (end offset, the SSE event's bytes)
EventMaker = Callable[[str, StreamInfo, int, str, bool], tuple[int, bytes]]


class LiveConnections:
    """Counts the long-poll and SSE responses one worker has open, up to a limit, and
    shows them in the `live_connections` gauge (metrics.py): one count, both moved at once.

    A gevent worker runs its greenlets on one thread and switches only on I/O, so a
    plain counter is exact without a lock. A live response holds its slot until it is
    closed (its body finished or the client gone), not just until its view returns.
    """

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.in_flight = 0
        self.gauge = gauge  # by mode: long-poll or sse

    def admit(self, mode: str) -> bool:
        """Take a slot; False when every slot is taken (answer 503, do not wait)."""
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        self.gauge.labels(mode).inc()
        return True

    def release(self, mode: str) -> None:
        self.in_flight -= 1
        self.gauge.labels(mode).dec()

    def busy(self) -> bool:
        return self.in_flight > 0

    def hold_until_closed(self, response: Response, mode: str) -> Response:
        """Give the slot taken by `admit` back when the response is closed."""
        response.call_on_close(functools.partial(self.release, mode))
        return response


class LiveReadEnded(Exception):
    """Raised in a live read's greenlet, at its wait, once `LiveRead.end` was called."""


class LiveRead:
    """A long-poll or SSE response that another greenlet may end before its deadline.

    The end is raised in the read's own greenlet, and only while it waits (for data, or
    parked with the fan-out), as gevent's Timeout is raised into a wait: every wait
    already leaves its stream as it found it when one is. Anywhere else the read meets
    `ended` at its next wait, which raises at once.
    """

    __slots__ = ("greenlet", "waiting", "ended")

    def __init__(self) -> None:
        self.greenlet = gevent.getcurrent()
        self.waiting = False
        self.ended = False

    def end(self) -> None:
        """End the read at its wait; returns at once (the hub raises it, in a callback)."""
        if not self.ended:
            self.ended = True
            gevent.get_hub().loop.run_callback(self._raise_at_wait)

    def _raise_at_wait(self) -> None:
        if self.waiting:  # else the read meets `ended` itself
            self.greenlet.throw(LiveReadEnded())

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait `end` may cut short with LiveReadEnded (raised at once if ended)."""
        if self.ended:
            raise LiveReadEnded()
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False


def live_wait(
    store: StreamStore, path: str, offset: int, timeout: float, incarnation: str | None
) -> StreamInfo:
    """The store's wait, cut short when the worker stops: then the stream as it is,
    so the live read answers at once with what it has, and its client resumes from
    Stream-Next-Offset on the next server instead of holding the stop."""
    try:
        return store.wait(path, offset, timeout, incarnation=incarnation)
    except WaitsEnded:
        return store.wait(path, offset, 0.0, incarnation=incarnation)


# -- SSE responses ------------------------------------------------------------------


class EventStreamResponse(Response):
    """An SSE answer whose generator the server iterates itself, with nothing between.

    Werkzeug hands the server a ClosingIterator over its `iter_encoded` generator: two
    more frames on the stack of every open SSE connection, for as long as it is open
    (figures: bench/README.md). The events are bytes already.
    """

    def get_app_iter(self, environ: dict) -> Iterable[bytes]:
        return GeneratorBody(self.response, self.close)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """Forget the headers once handed to the server: the body keeps this response
        until it closes, and with it headers nobody reads again, in every subscriber."""
        body = super().__call__(environ, start_response)
        self.headers.clear()
        return body


class GeneratorBody:
    """Iterates as its generator itself; closing it closes the generator, then the response."""

    __slots__ = ("events", "close_response")

    def __init__(
        self, events: Generator[bytes, None, None], close_response: Callable[[], None]
    ) -> None:
        self.events, self.close_response = events, close_response

    def __iter__(self) -> Iterator[bytes]:
        return self.events

    def close(self) -> None:
        try:
            self.events.close()
        finally:
            self.close_response()


class EventStreams:
    """The SSE responses of one worker: their events, built once per place in a stream
    and shared through a cache, and the fan-out that writes them at the tail."""

    def __init__(self, store: StreamStore, settings: Settings) -> None:
        self.store = store
        self.max_duration = settings.sse_max_duration
        self.wait_seconds = settings.long_poll_timeout  # then a control event, at the latest
        self.cache = ObjectCache(SSE_CACHE_BYTES)
        self.fanout = Fanout(store, self.event, advanced_cursor, settings.long_poll_timeout)

    def response(
        self,
        path: str,
        first: ReadResult,
        cursor: str,
        writer: DirectWriter | None,
        live_read: LiveRead,
    ) -> EventStreamResponse:
        """The SSE response that starts with the read the view made to check its offset.

        `writer`: the connection, when the server offers it (worker.py).
        """
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        content_type = first.info.content_type
        base64_data = not is_json_type(content_type) and not content_type.startswith("text/")
        if base64_data:
            headers[SSE_DATA_ENCODING] = "base64"
        events = self.events(path, first, cursor, base64_data, writer, live_read)
        return EventStreamResponse(events, 200, headers)

    def event(
        self,
        path: str,
        info: StreamInfo,
        offset: int,
        cursor: str,
        base64_data: bool,
        first: ReadResult | None = None,
    ) -> tuple[int, bytes]:
        """The data event from `offset` (if any) and its control event, built once.

        Stream bytes never change, so what one subscriber is sent for a place in the
        stream (offset, tail, closed, cursor) is right for every subscriber there: a
        message to 10,000 subscribers is read and formatted once, then only written.
        The data may end before the tail (the read cap); the next pass goes on from it.
        `first`: the read from `offset` the response starts with, made already.
        """
        key = (info.incarnation, offset, info.tail, info.closed, cursor, base64_data)
        cached = self.cache.get(key)
        if cached is not None:
            return int.from_bytes(cached[:8], "big"), cached[8:]
        end, data_event = offset, b""
        if info.tail > offset:
            result = first or self.store.read(
                path, offset, incarnation=info.incarnation, after_wait=True
            )
            end, data_event = result.end, format_data_event(b"".join(result.chunks), base64_data)
        # One write per pair: a reader never sees a data event without its control.
        event = data_event + format_control_event(info, end, cursor)
        self.cache.put(key, end.to_bytes(8, "big") + event)
        return end, event

    def events(
        self,
        path: str,
        first: ReadResult,
        cursor: str,
        base64_data: bool,
        writer: DirectWriter | None,
        live_read: LiveRead,
    ) -> Generator[bytes, None, None]:
        """Data events each followed by a control event, until closed, the deadline,
        the worker's stop or the read's end (`live_read`).

        At the tail, with a server that offers its connection (`writer`), the stream's
        broadcaster writes the events (`Fanout`) until it hands the connection back.
        The events come from one incarnation of the stream: when it is deleted the
        response ends, even if a new stream is created at the path.
        """
        deadline = time.monotonic() + self.max_duration
        info, incarnation = first.info, first.info.incarnation
        try:
            cursor = advanced_cursor(cursor)
            offset, event = self.event(path, info, first.start, cursor, base64_data, first)
            while True:
                yield event
                at_end = info.closed and offset == info.tail
                if at_end or time.monotonic() >= deadline or waits_ended():
                    return
                timeout = min(self.wait_seconds, deadline - time.monotonic())
                if writer is not None and offset == info.tail:
                    follower = Follower(
                        writer, incarnation, offset, cursor, base64_data, writer.chunked
                    )
                    if self.follow(path, follower, timeout, live_read):
                        if follower.failed:
                            return
                        if follower.unsent:
                            writer.send_rest(follower.unsent)
                        if follower.closed:
                            return
                        offset, cursor = follower.offset, follower.cursor
                        if follower.timed_out:
                            timeout = 0.0  # the pass that ends the response, or a control event
                with live_read.interruptible():
                    info = live_wait(self.store, path, offset, timeout, incarnation)
                cursor = advanced_cursor(cursor)
                offset, event = self.event(path, info, offset, cursor, base64_data)
        except (StoreError, StorageUnavailable, OSError) as error:  # OSError: from send_rest
            log.info("SSE on %s ended: %s", path, error)
        except LiveReadEnded:
            log.info("SSE on %s ended early (its token was revoked)", path)

    def follow(self, path: str, follower: Follower, timeout: float, live_read: LiveRead) -> bool:
        """`Fanout.follow`, unless the read is ended meanwhile: then the rest of an event
        the kernel took only part of goes out first, so the body ends with whole events."""
        try:
            with live_read.interruptible():
                return self.fanout.follow(path, follower, timeout)
        except LiveReadEnded:
            if follower.unsent:
                follower.writer.send_rest(follower.unsent)
            raise


def format_data_event(data: bytes, base64_data: bool) -> bytes:
    """One `data:` field per line of the data (CR, LF and CRLF all end a line in SSE).

    SSE parsers drop one space after `data:`, so a line that starts with a space gets
    one more; other lines get none, as the conformance suite expects (`data:line1`).
    """
    text = base64.b64encode(data) if base64_data else data
    lines = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    fields = (b"data: " + line if line[:1] == b" " else b"data:" + line for line in lines)
    return b"event: data\n" + b"\n".join(fields) + b"\n\n"


def format_control_event(info: StreamInfo, offset: int, cursor: str) -> bytes:
    control: dict[str, object] = {"streamNextOffset": format_offset(offset)}
    at_tail = offset == info.tail
    if info.closed and at_tail:
        control["streamClosed"] = True
    else:
        control["streamCursor"] = cursor
    if at_tail:
        control["upToDate"] = True
    return b"event: control\ndata:" + orjson.dumps(control) + b"\n\n"


# -- the fan-out --------------------------------------------------------------------


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
