"""Limits on what one request may cost a worker: live connections and JSON nesting.

Both are checked before the expensive part starts: a live read is refused with 503
before it waits, and a JSON body nested too deeply is refused with 400 before a
recursive parser or serialiser could run out of stack on it.
"""

from __future__ import annotations

import functools
import re

from flask import Response

# A JSON string, matched possessively so a hostile body cannot make the regex backtrack.
JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
BRACKETS = b"[]{}"
NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in BRACKETS)


class LiveConnections:
    """Counts the long-poll and SSE responses one worker has in flight, up to a limit.

    A gevent worker runs its greenlets on one thread and switches only on I/O, so a
    plain counter is exact without a lock. A live response holds its slot until it is
    closed (its body finished or the client gone), not just until its view returns.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def admit(self) -> bool:
        """Take a slot; False when every slot is taken (answer 503, do not wait)."""
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    def hold_until_closed(self, response: Response) -> Response:
        """Give the slot taken by `admit` back when the response is closed."""
        response.call_on_close(self.release)
        return response


def json_nests_deeper_than(body: bytes, limit: int) -> bool:
    """True if arrays and objects in `body` nest more than `limit` deep (the outer one is 1).

    Works on the bytes, without parsing and in linear time: strings are dropped
    (brackets inside them do not count), the remaining brackets must then match a
    regular expression of `limit` nested possessive groups, which fails at the first
    bracket too deep. Brackets that do not balance also count as too deep: such a body
    is not JSON, and the caller answers 400 either way. About 15 ns per bracket.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep
    brackets = JSON_STRING.sub(b"", body).translate(None, NOT_BRACKETS)
    brackets = brackets.replace(b"{", b"[").replace(b"}", b"]")
    return balanced_within(limit).fullmatch(brackets) is None


@functools.cache
def balanced_within(depth: int) -> re.Pattern[bytes]:
    """Balanced `[` `]` nested at most `depth` deep; possessive, so it never backtracks."""
    pattern = b""
    for _ in range(depth):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)
