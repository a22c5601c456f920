"""Revoked tokens: a list on storage that every process reads, and the check against it.

A token is good until its `exp`. A revocation refuses it sooner: one token, by its
`jti`, or every token of one subject (`sub`) issued until the revocation (an `iat` no
later than it, or none: "log this user out everywhere", while the tokens minted after
it work). Each names `until`, a time by which every token it refuses has expired
anyway; once that has passed, and the clock skew allowed on `exp` too, the revocation
has nothing left to refuse and the next listing deletes it.

Layout, under the storage root; each revocation is one object, created once:

    revocations/<until>-<at>-<kind>-<digest>    kind `jti` or `sub`, digest the SHA-256 of
                                                its value in hex, `at` when it was made
                                                (unix seconds); the body says the same
                                                in JSON, for people

The name holds all a check needs, so one listing reads the whole list: one request on
S3 for up to 1,000 revocations. Each process lists it once per `interval` while it serves
tokens (one was checked within the last interval, or a live read of one is open), and
never while idle; the first token after an idle spell waits for a listing. So a
revocation made anywhere is refused everywhere within `interval` plus the time one
listing takes, and at once in the process that made it; a live read whose token is
revoked is ended then too (`watch`). While storage does not answer, a process keeps the
list it read last: a revocation made meanwhile counts once storage answers again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import gevent
import orjson
from gevent.lock import Semaphore

from objectstore import ObjectStore, StorageUnavailable

log = logging.getLogger("picomq.revocations")

PREFIX = "revocations"
KINDS = ("jti", "sub")
MAX_REVOCATIONS = 10_000  # in force at once, across the cluster (as far as this process knows)
MAX_VALUE_BYTES = 1024  # of a jti or sub
MAX_UNTIL_SECONDS = 366 * 86400  # how far ahead `until` may lie
NAME = re.compile(r"(\d{1,12})-(\d{1,12})-(jti|sub)-([0-9a-f]{64})", re.ASCII)


class RevocationRefused(ValueError):
    """A revocation this server does not make; `code` for the 400 answer."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Revocation:
    kind: str  # "jti" or "sub"
    digest: str  # of the jti or sub (`digest_of`)
    until: int  # unix seconds: every token it refuses has expired by then
    at: int  # unix seconds: when it was made; a `sub` one refuses tokens issued until then

    @property
    def name(self) -> str:
        return f"{self.until}-{self.at}-{self.kind}-{self.digest}"

    @staticmethod
    def parse_name(name: str) -> Revocation | None:
        """None for any other name (left alone: this server did not make it)."""
        match = NAME.fullmatch(name)
        if match is None:
            return None
        until, at, kind, digest = match.groups()
        return Revocation(kind, digest, int(until), int(at))


def digest_of(value: str) -> str:
    """A value of any length and any characters as a fixed part of an object name."""
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TokenIds:
    """What a revocation may name in a token: the digests of its jti and sub, its iat."""

    jti: str | None
    sub: str | None
    issued_at: float | None

    @staticmethod
    def of(claims: Mapping[str, object]) -> TokenIds:
        """From verified claims (PyJWT checked that jti and sub are strings, iat a number)."""
        jti, sub, issued_at = claims.get("jti"), claims.get("sub"), claims.get("iat")
        return TokenIds(
            digest_of(jti) if isinstance(jti, str) else None,
            digest_of(sub) if isinstance(sub, str) else None,
            issued_at if isinstance(issued_at, int | float) else None,
        )


class Revocations:
    """This process's copy of the list, kept current while it checks tokens."""

    def __init__(self, objects: ObjectStore, interval: float, grace_seconds: int) -> None:
        """`grace_seconds`: how long past its `exp` a token is still taken (clock skew)."""
        self.objects = objects
        self.interval = interval
        self.grace_seconds = grace_seconds
        self._in_force: tuple[Revocation, ...] = ()
        self._tokens: frozenset[str] = frozenset()  # digests of revoked jti
        self._subjects: dict[str, int] = {}  # digest of a revoked sub: its latest `at`
        self._made_while_listing: list[Revocation] = []
        self._watched: dict[object, tuple[TokenIds, Callable[[], None]]] = {}
        self._used_at = 0.0
        self._listed_at = 0.0
        self._poller: gevent.Greenlet | None = None
        self._starting = Semaphore()

    # -- checks -------------------------------------------------------------------------

    def refuses(self, claims: Mapping[str, object]) -> bool:
        """Whether the token of these verified claims is revoked.

        Keeps the list current: after an idle spell, waits for one listing first.
        """
        self._used_at = time.monotonic()
        if self._poller is None:
            self._start_polling()
        return bool(self._tokens or self._subjects) and self._names(TokenIds.of(claims))

    def _names(self, token: TokenIds) -> bool:
        if token.jti is not None and token.jti in self._tokens:
            return True
        revoked_at = self._subjects.get(token.sub) if token.sub is not None else None
        if revoked_at is None:
            return False
        return token.issued_at is None or token.issued_at <= revoked_at

    def watch(self, claims: Mapping[str, object], end: Callable[[], None]) -> Callable[[], None]:
        """Call `end` once if this token is revoked while watched (a live read of it is
        open), and list meanwhile as if it were checked; the result stops watching."""
        key = object()
        self._watched[key] = (TokenIds.of(claims), end)
        return functools.partial(self._watched.pop, key, None)

    def _end_revoked_reads(self) -> None:
        for key, (token, end) in list(self._watched.items()):
            if self._names(token):
                del self._watched[key]
                end()

    # -- the list -----------------------------------------------------------------------

    def revoke(self, kind: str, value: str, until: int) -> Revocation:
        """Make a revocation: in force here at once, and everywhere within the interval.

        Raises RevocationRefused for a kind, value or until this server does not take,
        or with MAX_REVOCATIONS in force; StorageUnavailable when it cannot be stored.
        """
        now = int(time.time())
        check_revocation(kind, value, until, now - self.grace_seconds)
        if len(self._in_force) >= MAX_REVOCATIONS:
            raise RevocationRefused(
                f"{MAX_REVOCATIONS} revocations are in force; revoke by sub, or wait for"
                " some to pass their until",
                "too_many_revocations",
            )
        revocation = Revocation(kind, digest_of(value), until, now)
        body = orjson.dumps({kind: value, "until": until, "at": now})
        try:
            self.objects.create(f"{PREFIX}/{revocation.name}", body)
        except FileExistsError:
            pass  # the same revocation, made within the same second
        self._made_while_listing.append(revocation)
        self._adopt([*self._in_force, revocation])
        return revocation

    def _start_polling(self) -> None:
        """List now (the list may be as old as the idle spell), then every interval; the
        requests that come meanwhile wait for this listing too."""
        with self._starting:
            if self._poller is None:
                self._refresh()
                self._poller = gevent.spawn(self._poll_while_used)

    def _poll_while_used(self) -> None:
        try:
            while True:
                gevent.sleep(max(0.0, self._listed_at + self.interval - time.monotonic()))
                idle = time.monotonic() - self._used_at > self.interval
                if idle and not self._watched:
                    return
                self._refresh()
        finally:
            self._poller = None

    def _refresh(self) -> None:
        """One listing: the revocations in force replace the ones known; those past their
        until are deleted (by whichever process lists first)."""
        self._listed_at = time.monotonic()
        self._made_while_listing = []
        try:
            names = self.objects.list_after(PREFIX, "")  # one request on S3, even when empty
        except StorageUnavailable as error:
            log.warning("revocations not listed (the last list stays in force): %s", error)
            return
        in_force, expired = [], []
        oldest_in_force = time.time() - self.grace_seconds
        for revocation in filter(None, map(Revocation.parse_name, names)):
            (in_force if revocation.until >= oldest_in_force else expired).append(revocation)
        self._adopt(in_force + self._made_while_listing)
        if expired:
            self._delete(expired)

    def _adopt(self, in_force: Iterable[Revocation]) -> None:
        known = set(self._in_force)
        self._in_force = tuple(dict.fromkeys(in_force))
        self._tokens = frozenset(r.digest for r in self._in_force if r.kind == "jti")
        subjects: dict[str, int] = {}
        for revocation in self._in_force:
            if revocation.kind == "sub":
                subjects[revocation.digest] = max(revocation.at, subjects.get(revocation.digest, 0))
        self._subjects = subjects
        if not known.issuperset(self._in_force):
            self._end_revoked_reads()

    def _delete(self, expired: list[Revocation]) -> None:
        try:
            self.objects.delete_many([f"{PREFIX}/{revocation.name}" for revocation in expired])
        except StorageUnavailable as error:
            log.warning("expired revocations left for the next listing: %s", error)


def check_revocation(kind: str, value: str, until: int, oldest_in_force: float) -> None:
    """RevocationRefused unless this is a revocation to make."""
    if kind not in KINDS:
        raise RevocationRefused(f"revoke by {' or '.join(KINDS)}")
    if not value or len(value.encode()) > MAX_VALUE_BYTES:
        raise RevocationRefused(f"{kind} must be 1 to {MAX_VALUE_BYTES} bytes")
    if until < oldest_in_force:
        raise RevocationRefused("until has passed: a token that expired then is refused already")
    if until > time.time() + MAX_UNTIL_SECONDS:
        raise RevocationRefused(f"until must be within {MAX_UNTIL_SECONDS // 86400} days")
