"""Live readers' wake-ups: everyone on a change, each reader also by its own deadline.

gevent's `Event.wait(timeout)` builds a `Timeout` for every call (pure Python around a
libev timer, started and then stopped). An SSE subscriber waits once per event, so
with 10,000 subscribers on one stream those timeouts were a large part of the time
the worker spent delivering an event. Here readers whose deadlines fall in the same short
slot share one event and one timer: a wait costs a dict lookup, and a reader wakes at
most one slot after its deadline, which no long-poll or SSE client can tell apart.
`Alarms` does the same for callbacks: the SSE fan-out (live.py) hands its parked
subscribers back at their deadlines without a Timeout each.

When the worker stops, `end_waits` wakes every waiter for good: each wait, and every
wait begun after, raises `WaitsEnded`, so that long-polls and SSE responses answer with
what they have at once instead of holding the stop until their deadlines.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from typing import Any

from gevent.event import Event
from gevent.hub import get_hub

SLOT_SECONDS = 0.05


class WaitsEnded(Exception):
    """The worker is stopping (`end_waits`): a live read answers with what it has now."""


class Wakeups:
    """The waiters of one stream, in slots by deadline; `notify` wakes them all."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[Event, Any]] = {}  # slot number -> event, its timer
        _every_wakeups.add(self)

    def wait(self, deadline: float) -> None:
        """Block until `notify`, or about `deadline` (time.monotonic()); may return early.

        A timer started while the loop's clock lags (the loop reads it once per turn,
        and one turn can wake thousands of readers) fires early: callers re-check
        their own deadline and wait again. Raises WaitsEnded once `end_waits` was called.
        """
        _raise_if_ended()
        slot = slot_of(deadline)
        waiting = self._slots.get(slot)
        if waiting is None:
            waiting = self._slots[slot] = (Event(), start_timer(slot, self._ring))
        waiting[0].wait()
        _raise_if_ended()

    def _ring(self, slot: int) -> None:
        waiting = self._slots.pop(slot, None)
        if waiting is not None:
            _wake(*waiting)

    def notify(self) -> None:
        """Wake every waiter; whoever waits after this joins fresh slots."""
        if not self._slots:  # after most commits: no reader waits
            return
        slots, self._slots = self._slots, {}
        for waiting in slots.values():
            _wake(*waiting)


_every_wakeups: weakref.WeakSet[Wakeups] = weakref.WeakSet()
_waits_ended = False
_when_waits_end: list[Callable[[], None]] = []


def end_waits() -> None:
    """Wake every waiter of this process, and end every wait from now on at once: the
    worker is stopping. A live read waits only to answer with more data, which its
    client can as well ask the next server for; waiting, it would hold the stop."""
    global _waits_ended
    _waits_ended = True
    for wakeups in list(_every_wakeups):
        wakeups.notify()
    for callback in _when_waits_end:
        callback()


def when_waits_end(callback: Callable[[], None]) -> None:
    """Run `callback` when `end_waits` runs: another kind of live read ends with them."""
    _when_waits_end.append(callback)


def waits_ended() -> bool:
    return _waits_ended


def _raise_if_ended() -> None:
    if _waits_ended:
        raise WaitsEnded("the worker is stopping")


def _wake(event: Event, timer: Any) -> None:
    timer.close()
    event.set()


class Alarms:
    """Callbacks run at about their deadline (at most a slot late, or early as above)."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[list[Callable[[], None]], Any]] = {}

    def at(self, deadline: float, callback: Callable[[], None]) -> None:
        slot = slot_of(deadline)
        due = self._slots.get(slot)
        if due is None:
            due = self._slots[slot] = ([], start_timer(slot, self._ring))
        due[0].append(callback)

    def _ring(self, slot: int) -> None:
        callbacks, timer = self._slots.pop(slot)
        timer.close()
        for callback in callbacks:
            callback()


def slot_of(deadline: float) -> int:
    return math.ceil(deadline / SLOT_SECONDS)


def start_timer(slot: int, ring: Callable[[int], None]) -> Any:
    """A libev timer that calls `ring(slot)` when the slot ends (the loop's clock updated)."""
    timer = get_hub().loop.timer(max(0.0, slot * SLOT_SECONDS - time.monotonic()))
    timer.start(ring, slot, update=True)
    return timer
