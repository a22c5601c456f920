"""Live readers' wake-ups: everyone on a change, each reader also by its own deadline.

gevent's `Event.wait(timeout)` builds a `Timeout` for every call (pure Python around a
libev timer, started and then stopped). An SSE subscriber waits once per event, so
with 10,000 subscribers on one stream those timeouts were a third of the time the
worker spent delivering an event. Here readers whose deadlines fall in the same short
slot share one event and one timer: a wait costs a dict lookup, and a reader wakes at
most one slot after its deadline, which no long-poll or SSE client can tell apart.
"""

from __future__ import annotations

import math
import time
from typing import Any

from gevent.event import Event
from gevent.hub import get_hub

SLOT_SECONDS = 0.05


class Wakeups:
    """The waiters of one stream, in slots by deadline; `notify` wakes them all."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[Event, Any]] = {}  # slot number -> event, its timer

    def wait(self, deadline: float) -> None:
        """Block until `notify`, or about `deadline` (time.monotonic()); may return early.

        A timer started while the loop's clock lags (the loop reads it once per turn,
        and one turn can wake thousands of readers) fires early: callers re-check
        their own deadline and wait again.
        """
        slot = math.ceil(deadline / SLOT_SECONDS)
        waiting = self._slots.get(slot)
        if waiting is None:
            timer = get_hub().loop.timer(max(0.0, slot * SLOT_SECONDS - time.monotonic()))
            waiting = self._slots[slot] = (Event(), timer)
            timer.start(self._ring, slot, update=True)
        waiting[0].wait()

    def _ring(self, slot: int) -> None:
        waiting = self._slots.pop(slot, None)
        if waiting is not None:
            _wake(*waiting)

    def notify(self) -> None:
        """Wake every waiter; whoever waits after this joins fresh slots."""
        slots, self._slots = self._slots, {}
        for waiting in slots.values():
            _wake(*waiting)


def _wake(event: Event, timer: Any) -> None:
    timer.close()
    event.set()
