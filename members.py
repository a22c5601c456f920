"""Members and owners: which process serves which streams.

Every PicoMQ process serving through gunicorn is a *member*: a random id, an address
where the others can reach it (its peer listener, worker.py) and a heartbeat object.
Streams are spread over PARTITIONS by a hash of their path; each partition has at most
one owning member at a time, and only the owner serves its streams (the others forward
to it: forwarding.py). So a stream is created, appended to, read, waited on and deleted
by one process, which sees every change as it happens: no process serves a stale view,
and readers waiting on a stream cost no storage request.

Objects under the storage root (the heartbeat is the only one ever rewritten):

    cluster/members/<member>               empty; its modified time is the last heartbeat
    cluster/partitions/<p>/<epoch>         one claim of partition p: member, address

The highest epoch of a partition names its owner. A member claims a partition nobody
owns, or one whose owner's heartbeat is older than the lease, by creating the next
epoch: of two claimants, one wins. Ages are compared on the storage's clock: the
modified time of the other's heartbeat against that of the claimant's own (plus the
time since storage answered it); on one machine, a member whose process is gone is
dead at once. A heartbeat seen fresh is trusted until the lease it grants runs out.

An owner serves only while its lease holds by its own monotonic clock, counted from
when its last heartbeat was sent: a member paused past its lease (SIGSTOP, a stalled
VM) checks its claims again before it serves. A member heartbeats only while it is
asked to serve or holds live reads: an idle member costs no request, and lets its
leases lapse.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import gevent
import orjson
from gevent.event import AsyncResult
from gevent.lock import Semaphore

from objectstore import ObjectStore, StorageUnavailable

log = logging.getLogger("picomq.members")

PARTITIONS = 64
MEMBERS = "cluster/members"
CLAIMS = "cluster/partitions"
CLAIM_ATTEMPTS = 5
HOST = socket.gethostname()
PF_EXITING = 0x4  # a task's flag in proc(5) stat: its exit has begun


def _machine() -> str:
    """Who can see this process's pid: the host, its boot and the pid namespace. Two
    containers named alike, or a host rebooted, are other machines; where /proc does
    not tell, a name no other process has (its members are never judged by pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{HOST}/{boot.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{HOST}/{os.urandom(8).hex()}"


MACHINE = _machine()


@dataclass(frozen=True)
class Owner:
    """The member that claimed a partition last."""

    member: str
    address: str
    epoch: int
    host: str = ""
    pid: int = 0


def partition_of(path: str) -> int:
    return zlib.crc32(path.encode()) % PARTITIONS


def _process_exists(pid: int) -> bool:
    """Whether process `pid` may still act: some thread of it is neither a zombie nor
    exiting. A killed process closes its sockets as it exits, before it is a zombie: a
    forward refused then must find it gone. A leader that is a zombie while a thread of
    its pool still writes is not gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        return _signalable(pid)
    return any(_thread_acts(f"/proc/{pid}/task/{task}/stat") for task in tasks)


def _thread_acts(stat_path: str) -> bool:
    """Whether the thread is neither a zombie nor exiting, from its proc(5) stat line."""
    try:
        with open(stat_path, "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except FileNotFoundError:
        return False
    state, flags = fields[0], int(fields[6])
    return state not in b"ZX" and not flags & PF_EXITING


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    return True


class Membership:
    """This process as a member: its heartbeat, its partitions, and where others' are.

    `start(address)` makes it one; until then (an app served by another WSGI server,
    a test's in-process app) it owns everything and asks storage nothing.
    """

    def __init__(self, objects: ObjectStore, lease_seconds: float) -> None:
        self.objects = objects
        self.lease_seconds = lease_seconds
        self.member = f"{HOST}-{os.getpid()}-{os.urandom(4).hex()}"
        self.address: str | None = None
        self.owned: dict[int, int] = {}  # partition -> our epoch
        self.owners: dict[int, Owner] = {}  # others' partitions, as last read
        self.heartbeat_sent = float("-inf")  # monotonic, when the last heartbeat went
        self.heartbeat_answered: float | None = None  # and when storage said it landed
        self._beats_in_flight = 0
        self.active = float("-inf")  # monotonic, when we were last asked to serve
        # A partition changed hands (partition, ours now): what was held of its streams
        # may be stale.
        self.on_change: list[Callable[[int, bool], None]] = []
        self.busy: Callable[[], bool] = lambda: False  # live reads in flight: keep beating
        # This member's id, now and each time it takes a new one (`retire`).
        self.on_identity: list[Callable[[str], None]] = []
        # Replays a member's log (storage.py) before its partitions are served here;
        # fenced first, unless its process is known to be gone.
        self.replay: Callable[[str, bool], None] = lambda member, fence: None
        # Whether our log was fenced while our lease had lapsed (log.py).
        self.log_fenced: Callable[[], bool] = lambda: False
        self.retired: set[str] = set()  # ids this process gave up: dead, whatever beats
        self._replays: dict[str, AsyncResult] = {}
        self.on_start: list[Callable[[], None]] = []  # spawned once the member starts
        self._claims: dict[int, Owner] = {}  # the latest claim read of each partition
        # Others' heartbeats seen fresh: member -> when (monotonic) its lease runs out.
        self._alive_until: dict[str, float] = {}
        self._beating = False
        self._resolving = [Semaphore() for _ in range(PARTITIONS)]
        self._renewing = Semaphore()  # one beat for all who find the lease lapsed

    @property
    def started(self) -> bool:
        return self.address is not None

    def start(self, address: str) -> None:
        """Join as a member reachable at `address` ("host:port")."""
        self.address = address
        for begin in self.on_identity:
            begin(self.member)
        for started in self.on_start:
            gevent.spawn(started)

    def leave(self) -> None:
        """Stopping: the heartbeat goes, so that others take our partitions at once."""
        if self.started:
            self._delete_quietly([f"{MEMBERS}/{self.member}"])

    def retire(self) -> None:
        """Give up this member's id and everything it serves: its log was fenced (another
        member took over, believing it dead), or a flush's outcome is unknown. Its
        streams are served next by whoever replays its log first, this process too,
        as a new member."""
        old = self.member
        self.retired.add(old)
        self.member = f"{HOST}-{os.getpid()}-{os.urandom(4).hex()}"
        log.warning("member %s retires; this process is member %s now", old, self.member)
        for partition in list(self.owned):
            self._lose(partition)
        self.owners.clear()
        gevent.spawn(self._delete_quietly, [f"{MEMBERS}/{old}"])  # it is dead at once
        for begin in self.on_identity:
            begin(self.member)

    # -- routing -------------------------------------------------------------------

    def owner_for(self, path: str) -> Owner | None:
        """Who serves `path`'s stream: None for this process, else the owner to forward to.

        Claims the partition when nobody serves it. Raises StorageUnavailable when
        storage cannot say.
        """
        if not self.started:
            return None
        partition = partition_of(path)
        self.active = time.monotonic()
        if partition in self.owned and self._lease_holds():
            return None
        with self._resolving[partition]:  # one look at the claims at a time, for all asking
            if partition in self.owned and self._lease_holds():
                return None
            return self._resolve(partition)

    def _resolve(self, partition: int) -> Owner | None:
        self._keep_heartbeat()  # after a lapse, it lets go of what was taken (`_beat`)
        if partition in self.owned:
            return None
        owner = self.owners.get(partition) or self._read_owner(partition)
        if owner is None or (owner.member != self.member and self._is_dead(owner)):
            return self._claim(partition, owner)
        if owner.member == self.member:
            self.owned[partition] = owner.epoch
            return None
        self._lose(partition)
        self.owners[partition] = owner
        return owner

    def _lose(self, partition: int) -> None:
        if self.owned.pop(partition, None) is not None:
            log.info("member %s no longer owns partition %d", self.member, partition)
            for changed in self.on_change:
                changed(partition, False)

    def known_owner(self, path: str) -> Owner | None:
        """As `owner_for`, but another member's partition is sent to the owner last read
        without asking storage again: for internal requests, whose receiver checks that
        it serves the path and answers 421 if not (then `forget_owner`, and ask again)."""
        owner = self.owners.get(partition_of(path)) if self.started else None
        return owner if owner is not None else self.owner_for(path)

    def serves(self, path: str) -> bool:
        """Whether this member serves `path`'s stream alone right now: no other process
        writes it, so what this process holds of it is the whole truth."""
        return self.started and partition_of(path) in self.owned and self._lease_holds()

    def forget_owner(self, path: str) -> None:
        """The owner we forwarded to did not answer as one: read the claims again, and
        whether it lives (it may have retired: `retire`)."""
        owner = self.owners.pop(partition_of(path), None)
        if owner is not None:
            self._alive_until.pop(owner.member, None)

    def owner_is_dead(self, owner: Owner) -> bool:
        """After a forward to `owner` failed: whether its heartbeat has stopped (storage is
        asked again: an owner that stopped cleanly took its heartbeat with it)."""
        try:
            return self._is_dead(owner, ask=True)
        except StorageUnavailable:
            return False

    # -- claims --------------------------------------------------------------------

    def other_owners(self) -> list[Owner]:
        """The other members that own a partition, as the claims say now: those to tell of
        a change every owner must know before it serves again. One listing of the
        claims, and a read of each claim not read before."""
        owners = {}
        for partition, epoch in self._latest_epochs().items():
            owner = self._claims.get(partition)
            if owner is None or owner.epoch != epoch:
                owner = self._read_claim(partition, epoch)
            if owner is not None and owner.member != self.member:
                self._claims[partition] = owner
                owners[owner.member] = owner
        return list(owners.values())

    def _read_owner(self, partition: int) -> Owner | None:
        names = [name for name in self.objects.list(f"{CLAIMS}/{partition:02d}") if name.isdigit()]
        if not names:
            return None
        return self._read_claim(partition, max(map(int, names)))

    def _read_claim(self, partition: int, epoch: int) -> Owner | None:
        try:
            claim = orjson.loads(self.objects.read(f"{CLAIMS}/{partition:02d}/{epoch:010d}"))
        except FileNotFoundError:
            return None
        return Owner(claim["member"], claim["address"], epoch, claim["host"], claim["pid"])

    def _claim(self, partition: int, previous: Owner | None) -> Owner | None:
        """Create the next epoch of `partition`; on a lost race, the winner is the owner."""
        epoch = previous.epoch + 1 if previous else 1
        claim = {
            "member": self.member, "address": self.address, "host": MACHINE, "pid": os.getpid()
        }  # fmt: skip
        body = orjson.dumps(claim)
        for _ in range(CLAIM_ATTEMPTS):
            if previous is not None and previous.member != self.member:
                self._replay_once(previous)  # what it stored is in its streams first
            key = f"{CLAIMS}/{partition:02d}/{epoch:010d}"
            try:
                self.objects.create(key, body)
            except FileExistsError:
                owner = self._read_owner(partition)
                if owner is not None and owner.member == self.member:
                    self.owned[partition] = owner.epoch  # an earlier try of ours landed
                    return None
                if owner is None or self._is_dead(owner):
                    previous, epoch = owner or previous, (owner.epoch if owner else epoch) + 1
                    continue
                self._lose(partition)
                self.owners[partition] = owner
                return owner
            log.info("member %s claims partition %d (epoch %d)", self.member, partition, epoch)
            self.owned[partition] = epoch
            self.owners.pop(partition, None)
            for changed in self.on_change:
                changed(partition, True)
            if epoch > 1:  # the claims before are history: the listing stays one per partition
                gevent.spawn(self._delete_quietly, [f"{CLAIMS}/{partition:02d}/{epoch - 1:010d}"])
            return None
        raise StorageUnavailable(f"partition {partition}: too many claims at once; retry")

    def _replay_once(self, owner: Owner) -> None:
        """Replay a dead member's log, once per process: fenced, it can store no more.
        Partitions resolved at once wait for one replay. Its heartbeat goes after."""
        member = owner.member
        done = self._replays.get(member)
        if done is None:
            done = self._replays[member] = AsyncResult()
            try:
                self.replay(member, not self._gone_here(owner))
                self._delete_quietly([f"{MEMBERS}/{member}"])
                done.set(None)
            except BaseException as error:
                del self._replays[member]  # the next claim tries again
                done.set_exception(error)
                raise
        done.get()

    def _delete_quietly(self, keys: list[str]) -> None:
        try:
            self.objects.delete_many(keys)
        except StorageUnavailable as error:
            log.info("could not delete %s: %s", keys, error)

    def _is_dead(self, owner: Owner, *, ask: bool = False) -> bool:
        """Whether `owner`'s heartbeat is older than the lease, on the storage's clock, or
        its process, on this machine, is gone, or it is an id this process gave up.

        A heartbeat seen fresh keeps its owner alive until its lease runs out: nobody
        may take its partitions before then, so storage is not asked again meanwhile
        (every request forwarded to it would cost two HEADs), unless `ask`."""
        if owner.member in self.retired or self._gone_here(owner):
            return True
        if not ask and time.monotonic() < self._alive_until.get(owner.member, float("-inf")):
            return False
        self._alive_until.pop(owner.member, None)
        modified = self.objects.modified(f"{MEMBERS}/{owner.member}")
        if modified is None:
            return True
        left = self.lease_seconds - (self._storage_now() - modified)
        if left < 0:
            return True
        self._remember_alive(owner.member, time.monotonic() + left)
        return False

    def _remember_alive(self, member: str, until: float) -> None:
        """Note `member` alive until `until`; lapsed notes go (members come and go)."""
        if len(self._alive_until) >= PARTITIONS:
            now = time.monotonic()
            self._alive_until = {m: t for m, t in self._alive_until.items() if t > now}
        self._alive_until[member] = until

    def _storage_now(self) -> float:
        """The storage's clock now, or a little earlier, never later: our heartbeat's
        modified time, plus the time since storage answered that it landed. (Counted
        from when it was sent, a heartbeat slow to reach storage made every other
        member look older than it is: taken for dead while its lease held.)"""
        ours = self.objects.modified(f"{MEMBERS}/{self.member}")
        if ours is None:
            return time.time()
        if self._beats_in_flight or self.heartbeat_answered is None:
            return ours  # `ours` may be the beat in flight, whose answer is still to come
        return ours + (time.monotonic() - self.heartbeat_answered)

    @staticmethod
    def _gone_here(owner: Owner) -> bool:
        """Whether `owner` was a process of this machine that no longer runs."""
        return owner.host == MACHINE and owner.pid != os.getpid() and not _process_exists(owner.pid)

    # -- heartbeat -----------------------------------------------------------------

    def _lease_holds(self) -> bool:
        return time.monotonic() - self.heartbeat_sent < self.lease_seconds * 2 / 3

    def _keep_heartbeat(self) -> None:
        """Heartbeat now unless the lease holds, and every third of the lease while we
        are asked to serve."""
        with self._renewing:
            if not self._lease_holds():
                self._beat()
        if not self._beating:
            self._beating = True
            gevent.spawn(self._beat_while_active)

    def _beat(self) -> None:
        """Touch our heartbeat. After a lapse (the process was paused, or storage cut off,
        past the lease) the claims are looked at first: a beat must not make the lease
        hold again for partitions another member took meanwhile."""
        sent = time.monotonic()
        lapsed = not self._lease_holds()
        self._beats_in_flight += 1
        try:
            self.objects.touch(f"{MEMBERS}/{self.member}")
            self.heartbeat_answered = time.monotonic()
        finally:
            self._beats_in_flight -= 1
        if lapsed and self.owned:  # the claims, and our log's fence if one was taken
            self._check_claims()
        self.heartbeat_sent = sent

    def _beat_while_active(self) -> None:
        """One PUT every third of the lease, and a listing of the claims every lease."""
        try:
            for beat in itertools.count(1):
                if time.monotonic() - self.active >= self.lease_seconds and not self.busy():
                    break
                gevent.sleep(self.lease_seconds / 3)
                try:
                    self._beat()
                    if beat % 3 == 0:
                        self._check_claims()
                except StorageUnavailable as error:
                    log.warning("heartbeat failed: %s", error)
        finally:
            self._beating = False

    def _check_claims(self) -> None:
        """Let go of the partitions whose last claim is no longer ours: another member
        took one (it thought us dead, and fenced our log), or storage lost them. One
        listing of every claim."""
        latest = self._latest_epochs()
        lost = [p for p, epoch in self.owned.items() if latest.get(p) != epoch]
        for partition in lost:
            self.owners.pop(partition, None)
            self._lose(partition)
        if lost:
            self.log_fenced()  # taken from us as dead: fenced, we retire before a flush fails

    def _latest_epochs(self) -> dict[int, int]:
        """The highest epoch of each claimed partition: one listing of every claim."""
        latest: dict[int, int] = {}
        for name in self.objects.list_tree(CLAIMS):
            partition, _, epoch = name.partition("/")
            if partition.isdigit() and epoch.isdigit():
                latest[int(partition)] = max(latest.get(int(partition), 0), int(epoch))
        return latest
