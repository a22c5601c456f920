"""Live readers' wake-ups (wakeups.py), driven by gevent's real hub and clock.

What the store relies on: a change wakes every waiter whatever its deadline, a deadline
wakes its own waiters and nobody else's, and a waiter that comes after a change waits
for the next one. What the SSE fan-out relies on: an alarm runs once its deadline has
passed, and not before a later alarm's. What a stopping worker relies on: ending the
waits wakes every waiter of every stream at once, and refuses every wait after.
"""

from __future__ import annotations

import time

import gevent
import pytest

import wakeups as wakeups_module
from wakeups import SLOT_SECONDS, Alarms, WaitsEnded, Wakeups, end_waits

FAR_SECONDS = 30.0
JOIN_SECONDS = 5.0


def wait_until(wakeups: Wakeups, deadline: float) -> None:
    """Wait the way the store does, re-checking the deadline after each wake."""
    while time.monotonic() < deadline:
        wakeups.wait(deadline)


def test_notify_wakes_every_waiter_whatever_its_deadline() -> None:
    wakeups = Wakeups()
    now = time.monotonic()
    waiters = [gevent.spawn(wakeups.wait, now + FAR_SECONDS + index) for index in range(50)]
    gevent.sleep(0)
    assert not any(waiter.ready() for waiter in waiters)
    wakeups.notify()
    assert len(gevent.joinall(waiters, timeout=JOIN_SECONDS)) == len(waiters)


def test_a_deadline_wakes_its_own_waiters_only() -> None:
    wakeups = Wakeups()
    now = time.monotonic()
    soon = gevent.spawn(wait_until, wakeups, now + 0.2)
    later = gevent.spawn(wakeups.wait, now + FAR_SECONDS)
    soon.join(timeout=JOIN_SECONDS)
    assert soon.ready(), "a waiter's deadline passed and it was not woken"
    gevent.sleep(2 * SLOT_SECONDS)
    assert not later.ready(), "another waiter's deadline woke a waiter due much later"
    wakeups.notify()
    later.kill()


def test_a_deadline_already_past_returns_at_once() -> None:
    wakeups = Wakeups()
    past = gevent.spawn(wakeups.wait, time.monotonic() - 1.0)
    past.join(timeout=JOIN_SECONDS)
    assert past.ready()


def test_waiters_after_a_notify_wait_for_the_next_change() -> None:
    wakeups = Wakeups()
    deadline = time.monotonic() + FAR_SECONDS
    first = gevent.spawn(wakeups.wait, deadline)
    gevent.sleep(0)
    wakeups.notify()
    first.join(timeout=JOIN_SECONDS)
    second = gevent.spawn(wakeups.wait, deadline)  # the same slot as the first waiter's
    gevent.sleep(2 * SLOT_SECONDS)
    assert not second.ready(), "a waiter that came after the change was woken by it"
    wakeups.notify()
    second.join(timeout=JOIN_SECONDS)
    assert second.ready()


def test_alarms_run_each_callback_once_when_its_deadline_comes() -> None:
    alarms = Alarms()
    rang: list[str] = []
    now = time.monotonic()
    alarms.at(now + 0.1, lambda: rang.append("soon"))
    alarms.at(now + FAR_SECONDS, lambda: rang.append("later"))
    alarms.at(now + 0.1, lambda: rang.append("soon, too"))
    alarms.at(now + 0.3, lambda: rang.append("next"))
    while len(rang) < 3 and time.monotonic() < now + JOIN_SECONDS:
        gevent.sleep(SLOT_SECONDS)
    gevent.sleep(2 * SLOT_SECONDS)
    assert rang == ["soon", "soon, too", "next"]


def how_it_ends(wakeups: Wakeups, deadline: float) -> str:
    try:
        wakeups.wait(deadline)
    except WaitsEnded:
        return "ended"
    return "woken"


def test_ending_the_waits_wakes_every_waiter_and_ends_every_later_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wakeups_module, "_waits_ended", False)  # back as it was afterwards
    streams = [Wakeups(), Wakeups()]
    deadline = time.monotonic() + FAR_SECONDS
    waiters = [gevent.spawn(how_it_ends, wakeups, deadline) for wakeups in streams * 3]
    gevent.sleep(0)
    assert not any(waiter.ready() for waiter in waiters)
    end_waits()
    gevent.joinall(waiters, timeout=JOIN_SECONDS)
    assert [waiter.value for waiter in waiters] == ["ended"] * len(waiters)
    with pytest.raises(WaitsEnded):
        Wakeups().wait(deadline)
