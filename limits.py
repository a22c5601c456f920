"""Limits on what a JSON body may cost a worker: its nesting and its number of items.

Both are checked on the bytes, before the expensive part starts: a JSON body nested
too deeply is refused with 400 before a recursive parser or serialiser could run out
of stack on it, and an array of too many items with 413 before a parser makes an
object of each. (Live connections are counted in live.py.)
"""

from __future__ import annotations

import functools
import re

# Brackets and quotes are all the depth check needs of a JSON text; a quoted run left
# after empty strings are dropped holds only brackets that were inside strings.
STRUCTURE = b'[]{}"'
NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in STRUCTURE)
NOT_STRUCTURE_OR_COMMA = bytes(byte for byte in range(256) if byte not in STRUCTURE + b",")
QUOTED_RUN = re.compile(rb'"[^"]*+"')
BRACES_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
ESCAPED_BACKSLASH_OR_QUOTE = re.compile(rb'\\[\\"]')


def json_nests_deeper_than(body: bytes, limit: int) -> bool:
    """True if arrays and objects in `body` nest more than `limit` deep (the outer one is 1).

    Works on the bytes, without parsing and in linear time, with whole-buffer byte
    operations only (loops in C), as a batch of long messages passes through here
    (figures: bench/README.md). What is left of the body outside strings (`structure`)
    must match a regular expression of `limit` nested possessive groups, which fails at
    the first bracket too deep. Brackets that do not balance also count as too deep:
    such a body is not JSON, and the caller answers 400 either way.
    """
    skeleton = body.translate(None, NOT_STRUCTURE)
    if skeleton.count(b"[") + skeleton.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep
    return balanced_within(limit).fullmatch(structure(body, NOT_STRUCTURE)) is None


def json_array_longer_than(body: bytes, limit: int, max_depth: int) -> bool:
    """True if the JSON array `body` holds more than `limit` items, or may (it is no
    JSON, or nests deeper than `max_depth`: the caller answers 4xx either way).

    Counted before parsing, because a parser makes an object of every item: a 16 MiB
    array of zeros is 8 million of them. Items are separated by the commas that are
    neither in strings nor in nested arrays or objects; both are removed first.
    """
    if body.count(b",") < limit:
        return False
    skeleton = structure(body, NOT_STRUCTURE_OR_COMMA)
    first, last = skeleton.find(b"["), skeleton.rfind(b"]")
    if first < 0 or last <= first:
        return True
    top_level = nested_groups(max_depth).sub(b"", skeleton[first + 1 : last])
    return top_level.count(b",") + 1 > limit


def structure(body: bytes, dropped: bytes) -> bytes:
    """What is left of `body` outside its strings once the bytes `dropped` are deleted,
    with braces as brackets.

    Escaped backslashes and quotes go first; then, if any quote pair is not adjacent
    (a string holding a kept byte), every quoted run: removing an empty pair never
    moves a kept byte across a string edge.
    """
    skeleton = body.translate(None, dropped)
    if b"\\" in body:  # only inside strings; pairs read left to right, as a parser does
        skeleton = ESCAPED_BACKSLASH_OR_QUOTE.sub(b"", body).translate(None, dropped)
    if skeleton.count(b'""') * 2 != skeleton.count(b'"'):
        skeleton = QUOTED_RUN.sub(b"", skeleton.replace(b'""', b""))
    return skeleton.translate(BRACES_AS_BRACKETS, b'"')


@functools.cache
def balanced_within(depth: int) -> re.Pattern[bytes]:
    """Balanced `[` `]` nested at most `depth` deep; possessive, so it never backtracks."""
    pattern = b""
    for _ in range(depth):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)


@functools.cache
def nested_groups(depth: int) -> re.Pattern[bytes]:
    """One bracketed group, commas inside, nested at most `depth` deep; possessive."""
    group = rb"\[,*+\]"
    for _ in range(depth - 1):
        group = rb"\[(?:,|" + group + rb")*+\]"
    return re.compile(group)
