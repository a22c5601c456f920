"""Whole numbers from text that anyone may have written: the one parser of numeric input.

Every number PicoMQ reads from a request or a command line (headers, query parameters,
Content-Length, command options) goes through `parse_decimal`, because Python's own
checks let too much through: `str.isdigit()` is true of '²', '٣' and '３', `int()`
takes '٣', '+1', ' 1' and '1_0', and both `int()` and a comparison after it raise
ValueError past 4,300 digits, which a view that trusted them answered with a 500.
"""

from __future__ import annotations

import re

# Enough for 2^53 - 1, the largest number the protocol exchanges (a JavaScript
# client's safe integer), and far below int()'s limit.
MAX_DECIMAL_DIGITS = 16
MAX_SAFE_INTEGER = 2**53 - 1
DECIMAL_PATTERN = re.compile(rf"0|[1-9][0-9]{{0,{MAX_DECIMAL_DIGITS - 1}}}")


def parse_decimal(text: str, maximum: int = MAX_SAFE_INTEGER) -> int:
    """0 … `maximum`, written in ASCII digits without sign, space or leading zero, at
    most MAX_DECIMAL_DIGITS of them; ValueError (with a message to pass on) otherwise."""
    if DECIMAL_PATTERN.fullmatch(text) is None or int(text) > maximum:
        raise ValueError(
            f"must be a whole number from 0 to {maximum} in ASCII digits,"
            " without sign, spaces or leading zeros"
        )
    return int(text)
