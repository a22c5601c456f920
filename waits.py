"""Live waits: a reader waits until a stream grows past its offset, closes, or time is up.

Appends made in this process wake their stream's readers at once (wakeups.py). A
stream this process serves alone (members.py) has no other writer, and its readers
cost nothing more. Other processes' appends are found by looking for the next
segment, and only while someone waits, so idle streams cost nothing: on local disk
when an inotify watch says a file was added to the segment directory (dirwatch.py),
with a timed look as a safety net; elsewhere every `poll_interval`, each look a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent
from gevent.event import Event

from objectstore import StorageUnavailable
from pieces import Pieces
from streams import OffsetTrimmed, Stream, StreamInfo


class Waits:
    """The live readers of this process's streams, and their pollers."""

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.objects = pieces.objects
        self.settings = pieces.settings

    def wait(self, stream: Stream, offset: int, timeout: float) -> StreamInfo:
        """Return once the stream has data past `offset` (or past the tail, if `offset` is
        beyond it), is closed, or `timeout` passed.

        A waiter learns of other processes' appends by looking for the next segment
        (`_poll`), so a handle checked, or a tail confirmed, within `poll_interval` is
        taken as it is: an SSE subscriber back for the next event costs no storage
        request, which is what lets one worker follow a stream with thousands of
        subscribers. A stream deleted in this process ends its waits (StreamNotFound;
        StreamGone while forks keep it); one deleted by another process too, on local
        disk with a watch (see `_poll`), else at the next wait, through its incarnation
        (`StreamStore._open`).
        """
        poll_interval = self.settings.poll_interval
        confirmed = stream.alone or self.pieces.tail_confirmed(stream, poll_interval)
        if offset >= stream.state.tail and not confirmed:
            self.pieces.refresh_if_reachable(stream)
        offset = min(offset, stream.state.tail)  # past the tail waits at it (see `read`)
        if offset < stream.earliest:
            raise OffsetTrimmed(stream.earliest)
        deadline = time.monotonic() + timeout
        stream.waiters += 1
        try:
            while stream.state.tail <= offset and not stream.state.closed:
                if time.monotonic() >= deadline:
                    break
                if not stream.polling and not stream.alone:  # alone: no one else appends
                    stream.polling = True
                    gevent.spawn(self._poll, stream)
                stream.wakeups.wait(deadline)
                stream.raise_if_retired()
        finally:
            stream.waiters -= 1
        return stream.info()

    def _poll(self, stream: Stream) -> None:
        """While readers wait, look for segments written by other processes.

        Where a watch on the segment directory can be added (local disk, Linux), it says
        when to look, and a timed look every `watched_poll_interval` is the safety net.
        Without one, look every `poll_interval`, as on object stores; a stream from
        before directories were made at create has none until its first segment. A look
        the watch asked for that finds no segment may be the directory's removal: when
        meta.json is no longer this handle's, another process deleted the stream, and
        its waiters end with a 404 instead of answering at their deadline.
        """
        nudged = Event()
        stop_watching = self._watch(stream, nudged)
        try:
            while stream.waiters > 0 and not stream.state.closed:
                was_nudged = False
                if stop_watching is None:
                    gevent.sleep(self.settings.poll_interval)
                else:
                    was_nudged = nudged.wait(self.settings.watched_poll_interval)
                    nudged.clear()
                try:
                    found = self.pieces.refresh(stream)
                    if was_nudged and not found and self.pieces.deleted_elsewhere(stream):
                        stream.end_waits()  # its segment directory went: 404 now, not at timeout
                except StorageUnavailable:
                    continue
                if found and stop_watching is None:
                    stop_watching = self._watch(stream, nudged)
        finally:
            if stop_watching is not None:
                stop_watching()
            stream.polling = False

    def _watch(self, stream: Stream, nudged: Event) -> Callable[[], None] | None:
        """Set `nudged` when another process may have added a segment; None if unwatched."""

        def on_create(name: str) -> None:
            if self.may_be_news(stream, name):
                nudged.set()

        stop_watching = self.objects.watch_creates(f"{stream.prefix}/seg", on_create)
        if stop_watching is not None:
            nudged.set()  # a segment added before the watch has no event: look once now
        return stop_watching

    @staticmethod
    def may_be_news(stream: Stream, name: str) -> bool:
        """Whether a new entry in the segment directory could be a segment we do not know.

        Temporary files and segments behind the tail are not; nor is the one our writer
        is creating: if another process took that name, our create fails and the writer
        catches up and wakes the readers itself. Looking at our own would read back a
        segment the writer has in hand, before its create even returned.
        """
        if not name:  # events were lost
            return True
        if not name.isdigit():
            return False
        start = int(name)
        return start >= stream.state.tail and start != stream.creating
