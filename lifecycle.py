"""A stream's end: deletes, soft deletes while forks read it, and the markers that make
deletes, forks and trims see one another.

Objects under a stream's incarnation folder, each created once:

    deleting            a DELETE has begun: new forks are refused
    gone                soft-deleted: the stream answers 410, its forks still read it
    forks/<key>+<inc>   one marker per fork that reads it (written by the fork)
    trimming/<pos>      retention's intent to trim, while it looks for forks
    trim/<pos>          retention dropped the data below <pos> (retention.py)

Each side writes its marker before it looks for the other's: a fork its marker before
it looks for `deleting` (and for trims), a delete `deleting` before it lists the
markers, retention its intent before its second look. Storage lists and reads what was
written before, so one of the two always sees the other. Deleting meta.json is the
commit point of a delete; a stream's data goes after it, and a soft-deleted source
goes with its last fork.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from objectstore import ObjectStore, StorageUnavailable
from streams import (
    Handles,
    OffsetTrimmed,
    Stream,
    StreamConflict,
    StreamNotFound,
    highest_offset,
    read_config,
    segment_name,
)

log = logging.getLogger("picomq.storage")

# A fork being created marks its source, then writes its meta.json within
# FORK_SETUP_SECONDS or gives up. Until a marker is FORK_MARKER_SECONDS old, a delete
# of the source counts it as a fork even without that meta.json; the margin covers
# nodes and storage whose clocks disagree. Retention's intent to trim is bounded the
# same way (`publish_trim`).
FORK_SETUP_SECONDS = 10.0
FORK_MARKER_SECONDS = 60.0


class Lifecycle:
    """Deletes and the markers of forks and trims, over the objects of every stream."""

    def __init__(
        self, objects: ObjectStore, handles: Handles, erased: Callable[[Stream], None]
    ) -> None:
        """`handles`: the process's open handles, from which an erased stream's goes;
        `erased(stream)` runs once a stream is erased (its held records go)."""
        self.objects = objects
        self.handles = handles
        self.erased = erased

    def retire(self, stream: Stream) -> bool:
        """Delete, or soft-delete while forks still read the data; True if soft.

        Each marker is written before the look that depends on it: `deleting` before
        the first look for forks (against forks being created, `_mark_source`), `gone`
        before the second (against the last fork going meanwhile, `_release_source`).
        """
        self._mark_stream(stream, "deleting")
        if self.has_forks(stream):
            self._mark_stream(stream, "gone")
            stream.soft_delete()
            if self.has_forks(stream):
                return True
            self._erase_if_there(stream)  # the last fork, going, may have erased it first
            return False
        try:
            self.erase(stream)
        except StreamNotFound:
            self.remove_leftovers(stream)  # `deleting`, if the winner erased it first (S3)
            raise
        return False

    def _mark_stream(self, stream: Stream, name: str) -> None:
        """Write the marker `name` into a stream's folder; a 404 if another process
        erased the stream, folder and all."""
        if not self._create_marker(f"{stream.prefix}/{name}"):
            raise StreamNotFound(f"stream {stream.config.path} was deleted")

    def publish_trim(self, stream: Stream, earliest: int) -> bool:
        """Make `earliest` the stream's earliest offset, unless a fork reads it: False.

        As with deletes, each side writes before it looks: retention its intent
        (`trimming/<offset>`, which readers never see) before its second look for
        forks, a fork its marker before it looks for intents and trims (`_take_trims`).
        So no trim is published that a fork's earliest offset does not take into account.
        An intent is given up after FORK_SETUP_SECONDS, and one a crash left behind is
        ignored once FORK_MARKER_SECONDS old.
        """
        intent = f"{stream.prefix}/trimming/{segment_name(earliest)}"
        started = time.monotonic()
        if self.has_forks(stream) or not self._create_marker(intent):
            return False
        try:
            return (
                not self.has_forks(stream)
                and time.monotonic() - started <= FORK_SETUP_SECONDS
                and self._create_marker(stream.trim_key(earliest))
            )
        finally:
            self.objects.delete_tree(intent)

    def _create_marker(self, key: str) -> bool:
        """Create the empty object `key` unless it exists (another request wrote it, or
        this one did and lost the answer); False if its folder is gone (local disk)."""
        try:
            self.objects.create(key, b"")
        except FileExistsError:
            pass
        except FileNotFoundError:
            return False
        return True

    def has_forks(self, stream: Stream) -> bool:
        """True while a fork reads the stream, or may be about to (one being created)."""
        return any(
            self._fork_reads(f"{stream.prefix}/forks/{name}", name)
            for name in self.objects.list(f"{stream.prefix}/forks")
        )

    def _fork_reads(self, marker: str, name: str) -> bool:
        """Whether the fork that wrote `marker` reads its source; removes stale markers.

        A marker without its fork's meta.json is a fork being created until it is
        FORK_MARKER_SECONDS old, then what a fork that failed or went left behind.
        """
        key, _, incarnation = name.partition("+")
        try:
            if not incarnation:  # written before markers were named by incarnation
                incarnation = self.objects.read(marker).decode()
        except FileNotFoundError:
            pass
        else:
            if self.created_by(key, incarnation):
                return True
        if _younger(self.objects.modified(marker)):
            return True
        self.objects.delete_tree(marker)
        return False

    def erase(self, stream: Stream) -> None:
        """Delete meta.json (the commit point), then the data; a lost race is a 404."""
        config = stream.config
        self.handles.discard(config.path, stream)
        try:
            if not self.created_by(stream.key, config.incarnation):
                raise FileNotFoundError(config.path)
            self.objects.delete(stream.meta_key)
        except FileNotFoundError as error:
            stream.end_waits()  # erased by another request first
            raise StreamNotFound(f"stream {config.path} not found") from error
        stream.end_waits()
        self.erased(stream)
        self.remove_leftovers(stream)
        if stream.source is not None:
            self._release_source(stream.source, stream)

    def _release_source(self, source: Stream, fork: Stream) -> None:
        """Remove a fork's marker; a soft-deleted source goes with its last fork.

        The marker goes before the look for `gone` (see `_retire`).
        """
        self.objects.delete_tree(_fork_marker(source, fork))
        if self.objects.exists(f"{source.prefix}/gone") and not self.has_forks(source):
            self._erase_if_there(source)  # its delete, or another fork going, may be first

    def _erase_if_there(self, stream: Stream) -> None:
        try:
            self.erase(stream)
        except StreamNotFound:
            pass

    def remove_leftovers(self, stream: Stream) -> None:
        """Remove the folder of a stream that no longer exists; a writer that raced its
        deletion may have left a segment behind, which is only logged."""
        try:
            self.objects.delete_tree(stream.prefix)
        except (OSError, StorageUnavailable) as error:
            log.warning("leftover data of deleted stream %s: %s", stream.config.path, error)

    def mark_source(self, source: Stream, fork: Stream) -> None:
        """Tell deletes of `source` that `fork`, being created, is about to read it, or refuse.

        The fork writes its marker before it looks for the source's `deleting` marker,
        and a delete writes that before it lists the markers (`_retire`): one of the two
        always sees the other, as storage lists and reads what was written before.
        """
        marked_at = time.monotonic()
        if not (
            self._create_marker(_fork_marker(source, fork))
            and not self.objects.exists(f"{source.prefix}/deleting")
            and self.created_by(source.key, source.config.incarnation)
            and time.monotonic() - marked_at <= FORK_SETUP_SECONDS
        ):
            self.abandon(fork, source)
            raise StreamConflict(f"fork source {source.config.path} was deleted")
        self._take_trims(source, fork)

    def _take_trims(self, source: Stream, fork: Stream) -> None:
        """Start `fork` no lower than its source's retention trimmed, or set out to trim,
        since it was validated (`publish_trim`). Intents are listed first: one may be
        replaced by its trim between the two listings, never the other way round."""
        origin = fork.config.fork
        assert origin is not None
        names = [
            name
            for name in self.objects.list(f"{source.prefix}/trimming")
            if _younger(self.objects.modified(f"{source.prefix}/trimming/{name}"))
        ]
        names += self.objects.list(f"{source.prefix}/trim")
        earliest = highest_offset(names, default=0)
        if earliest <= origin.earliest:
            return
        if origin.point < earliest:
            self.abandon(fork, source)
            raise OffsetTrimmed(earliest)
        fork.inherit_trim(earliest)

    def abandon(self, stream: Stream, source: Stream | None) -> None:
        """Remove what a create that did not take place wrote: data, and a fork's marker."""
        self.remove_leftovers(stream)
        if source is not None:
            self._release_source(source, stream)

    def created_by(self, key: str, incarnation: str) -> bool:
        config = read_config(self.objects, key)
        return config is not None and config.incarnation == incarnation


def _fork_marker(source: Stream, fork: Stream) -> str:
    """The key of the object that tells deletes of `source` that `fork` reads it."""
    return f"{source.prefix}/forks/{fork.key}+{fork.config.incarnation}"


def _younger(modified: float | None) -> bool:
    """Whether a marker modified then (None: gone) may still be one being acted on."""
    return time.time() - (modified or 0.0) < FORK_MARKER_SECONDS
