"""Members judging each other by their heartbeats, in process on local disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gevent
import pytest
from conftest import soon

from members import PF_EXITING, Membership, Owner, _process_exists, _thread_acts, partition_of
from storage import open_objects

LEASE_SECONDS = 3.0
SLOW_BEAT_SECONDS = 2.0  # how late our heartbeat reaches storage: within the lease
STREAM = "a/stream"


def member(root: Path, address: str) -> Membership:
    membership = Membership(open_objects(str(root)), LEASE_SECONDS)
    membership.address = address  # started, without the greenlets `start` spawns
    return membership


def owner(membership: Membership) -> Owner:
    return Owner(membership.member, membership.address or "", epoch=1, host="elsewhere")


@pytest.mark.parametrize("slow", [False, True])
def test_a_member_alive_by_its_lease_is_not_taken_for_dead(tmp_path: Path, slow: bool) -> None:
    """A heartbeat of ours that reached storage late must not make the other's look
    older than it is: the other beat 2.5 s ago, its lease is 3 s, so it is alive, and
    would still serve what we would take from it."""
    other, we = member(tmp_path, "127.0.0.1:1"), member(tmp_path, "127.0.0.1:2")
    other._beat()
    objects, touch = we.objects, we.objects.touch

    def late_touch(key: str) -> None:
        if slow:
            gevent.sleep(SLOW_BEAT_SECONDS)  # sent at once, landed this much later
        touch(key)

    objects.touch = late_touch  # type: ignore[method-assign]
    we._beat()
    gevent.sleep(2.5 - (SLOW_BEAT_SECONDS if slow else 0.0))
    assert not we._is_dead(owner(other), ask=True)
    gevent.sleep(LEASE_SECONDS - 2.5 + 0.5)
    assert we._is_dead(owner(other), ask=True)


def test_an_owner_seen_alive_is_not_asked_after_again_until_its_lease_ends(
    tmp_path: Path,
) -> None:
    """Every request forwarded to an owner asks whether it is dead: storage is asked
    once per lease, and again at once after a forward failed (`ask`) or the owner
    answered that it does not serve the stream (`forget_owner`: it may have retired)."""
    other, we = member(tmp_path, "127.0.0.1:1"), member(tmp_path, "127.0.0.1:2")
    other._beat()
    we._beat()
    asked = []
    modified = we.objects.modified

    def counted(key: str) -> float | None:
        asked.append(key)
        return modified(key)

    we.objects.modified = counted  # type: ignore[method-assign]
    for _ in range(100):
        assert not we._is_dead(owner(other))
    assert len(asked) == 2  # its heartbeat and ours, once
    assert not we._is_dead(owner(other), ask=True)
    assert len(asked) == 4
    other.objects.delete_many([f"cluster/members/{other.member}"])  # it stopped or retired
    assert not we._is_dead(owner(other))  # as storage said a moment ago
    assert we._is_dead(owner(other), ask=True)
    assert we._is_dead(owner(other))  # no longer remembered as alive

    third = member(tmp_path, "127.0.0.1:3")
    third._beat()
    assert not we._is_dead(owner(third))
    we.owners[partition_of(STREAM)] = owner(third)
    third.objects.delete_many([f"cluster/members/{third.member}"])
    we.forget_owner(STREAM)  # it answered 421 to a forward
    assert we._is_dead(owner(third))


# A process whose first thread ends while another thread of it goes on: the leader is
# a zombie, the process still acts (as a worker killed mid-write may, in its pool).
LEADER_ENDS_FIRST = """
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(30,)).start()
sys.stdout.write("ready\\n")
sys.stdout.flush()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_is_gone_only_when_no_thread_of_it_can_act() -> None:
    """On one machine a member is dead once its process is: a forward refused by a
    killed owner, whose sockets closed as it began to exit, is served at once. But a
    process whose first thread is a zombie while another still runs is not gone."""
    command = [sys.executable, "-c", LEADER_ENDS_FIRST]
    with subprocess.Popen(command, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            leader = Path(f"/proc/{child.pid}/stat")
            assert soon(lambda: leader.read_bytes().rpartition(b")")[2].split()[0] == b"Z")
            assert _process_exists(child.pid)
            os.kill(child.pid, signal.SIGKILL)
            assert soon(lambda: not _process_exists(child.pid))  # a zombie, not reaped
        finally:
            child.kill()
    assert not _process_exists(child.pid)


def test_a_thread_whose_exit_has_begun_does_not_act(tmp_path: Path) -> None:
    """The moment between a kill and the zombie, read from a thread's stat line (one
    cannot be held open long enough to look at): its exit flag says it is going."""
    ours = Path(f"/proc/self/task/{os.getpid()}/stat").read_bytes()
    head, _, rest = ours.rpartition(b")")
    fields = rest.split()
    fields[6] = str(int(fields[6]) | PF_EXITING).encode()
    exiting = head + b") x) " + b" ".join(fields)  # a name may hold ") "
    (tmp_path / "ours").write_bytes(ours)
    (tmp_path / "exiting").write_bytes(exiting)
    assert _thread_acts(str(tmp_path / "ours"))
    assert not _thread_acts(str(tmp_path / "exiting"))
    assert not _thread_acts(str(tmp_path / "gone"))
