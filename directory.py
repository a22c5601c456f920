"""The directory: which subscriptions link which streams, as every member knows it.

A subscription is served by the member that serves its key, a stream by the member
that serves its path (members.py): often two members. When a stream grows, the member
that committed it tells each subscription that links it (subscriptions.py, through
peers.py). So every member keeps this directory: each subscription's id, incarnation,
pattern, wake stream and the streams it links by name. Acknowledgements, wakes, and
the links a pattern made stay with the subscription's own member.

It is kept current three ways; the first is the one that counts, the others catch up
on what it missed:
- a subscription's member tells every member that owns a partition of each create,
  delete and change of named links, before it answers the request that made it;
- a member that begins to serve a partition reads the directory from storage again
  before it tells anyone of its next commit (while it served nothing, nobody told it);
- a member that commits reads it again every REFRESH_SECONDS, and once more after its
  last commit, should word of a change have failed to reach it.
What a member learns late (a subscription, or a named link, it did not know), it makes
good at once (`on_learn`): it tells the subscription of every stream it holds that the
subscription links, as those may have grown while it did not know.

A subscription the directory names after its delete costs a message its member ignores;
one it lacks would miss a wake. So it errs on the side of naming.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import gevent
from gevent.event import AsyncResult

from auth import matches
from objectstore import StorageUnavailable

log = logging.getLogger("picomq.directory")

REFRESH_SECONDS = 30.0


@dataclass(frozen=True)
class Entry:
    """What a stream's member must know of one subscription to tell it of the stream."""

    id: str
    incarnation: str
    pattern: tuple[str, ...] | None  # a glob's segments, as auth.matches takes them
    wake_stream: str | None
    named: frozenset[str]  # streams linked explicitly

    def links(self, path: str) -> bool:
        if path in self.named:
            return True
        if self.pattern is None or path == self.wake_stream:
            return False
        return matches(self.pattern, tuple(path.split("/")))

    def to_json(self) -> dict:
        pattern = "/".join(self.pattern) if self.pattern is not None else None
        return {"id": self.id, "incarnation": self.incarnation, "pattern": pattern,
                "wake_stream": self.wake_stream, "named": sorted(self.named)}  # fmt: skip

    @staticmethod
    def from_json(fields: dict) -> Entry:
        pattern = fields["pattern"]
        return Entry(
            fields["id"], fields["incarnation"],
            tuple(pattern.split("/")) if pattern is not None else None,
            fields["wake_stream"], frozenset(fields["named"]),
        )  # fmt: skip


def learned(old: Entry | None, new: Entry) -> Entry | None:
    """What of `new` a member that knew `old` did not know: all of it, its new named
    links only (as an entry with no pattern), or nothing."""
    if old is None or old.incarnation != new.incarnation:
        return new
    added = new.named - old.named
    return replace(new, pattern=None, named=added) if added else None


Load = Callable[[dict[str, Entry]], dict[str, Entry]]


class Directory:
    """The entries of every subscription, and when to read them again.

    `load(known)` reads every entry from storage; it may reuse those in `known` that it
    finds unchanged. `on_learn(entries)` is called with what was learned late.
    """

    def __init__(self, load: Load) -> None:
        self._load = load
        self.on_learn: Callable[[list[Entry]], None] = lambda entries: None
        self.entries: dict[str, Entry] = {}
        self.stale = True  # never read, or this member began to serve another partition
        self._read_at = float("-inf")  # monotonic, when the last read began
        self._reading: AsyncResult | None = None
        self._told_while_reading: list[dict] = []
        self._timer: gevent.Greenlet | None = None

    def linking(self, path: str) -> list[str]:
        """The ids of the subscriptions that link `path`."""
        return [entry.id for entry in self.entries.values() if entry.links(path)]

    def due_after_commit(self) -> bool:
        """Whether a read is due now. If not, one is made once it is, though no commit
        follows (one timer): a single call, as each commit in the process makes one."""
        now = time.monotonic()
        if self.stale or now - self._read_at >= REFRESH_SECONDS:
            return True
        if self._timer is None:
            self._timer = gevent.spawn_later(
                self._read_at + REFRESH_SECONDS - now, self._timed_read
            )
        return False

    def _timed_read(self) -> None:
        self._timer = None
        try:
            self.read()
        except StorageUnavailable as error:
            log.warning("the subscription directory could not be read: %s", error)

    def read(self) -> None:
        """Read the directory from storage (one read at a time: others wait for it), then
        apply what was told meanwhile, then make good what was learned late. Raises
        StorageUnavailable (the directory stays due)."""
        if self._reading is not None:
            self._reading.get()
            return
        self._reading, self._told_while_reading = AsyncResult(), []
        self.stale, started = False, time.monotonic()
        try:
            entries = self._load(dict(self.entries))
        except BaseException as error:
            self.stale = True
            self._reading.set_exception(error)
            raise
        finally:
            reading, self._reading = self._reading, None
        found = [learned(self.entries.get(key), entry) for key, entry in entries.items()]
        self.entries, self._read_at = entries, started
        for change in self._told_while_reading:
            self._apply(change)
        reading.set(None)
        self.on_learn([entry for entry in found if entry is not None])

    # -- told by a subscription's member ------------------------------------------------

    def apply(self, change: dict) -> None:
        """A change a subscription's member told (`put_change` and the like)."""
        if self._reading is not None:
            self._told_while_reading.append(change)  # the read may not have seen it
        news = self._apply(change)
        if news is not None:
            self.on_learn([news])

    def _apply(self, change: dict) -> Entry | None:
        if "put" in change:
            entry = Entry.from_json(change["put"])
            news = learned(self.entries.get(entry.id), entry)
            self.entries[entry.id] = entry
            return news
        current = self.entries.get(change["id"])
        if current is None or current.incarnation != change["incarnation"]:
            self.stale = True  # told of one it does not know: it missed a word
            return None
        if "drop" in change:
            del self.entries[current.id]
            return None
        named = (current.named | set(change["added"])) - set(change["removed"])
        entry = replace(current, named=frozenset(named))
        self.entries[entry.id] = entry
        return learned(current, entry)


def put_change(entry: Entry) -> dict:
    return {"put": entry.to_json()}


def drop_change(subscription_id: str, incarnation: str) -> dict:
    return {"drop": True, "id": subscription_id, "incarnation": incarnation}


def name_change(
    subscription_id: str, incarnation: str, added: list[str], removed: list[str]
) -> dict:
    return {"id": subscription_id, "incarnation": incarnation, "added": added, "removed": removed}
