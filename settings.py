"""Every setting PicoMQ reads, declared once: name, default, validation and meaning.

Settings come from `PICOMQ_*` environment variables and are validated at start, so
a typo fails the boot with a message instead of a request with a 500. The README's
settings table is checked against `SETTINGS` by the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields


class SettingsError(ValueError):
    """A PICOMQ_* variable has a value PicoMQ cannot use."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive number")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def _auto_or_positive_float(text: str) -> float | None:
    return None if text.strip() == "auto" else _positive_float(text)


def _optional_positive_int(text: str) -> int | None:
    return None if text.strip() == "none" else _positive_int(text)


def _log_format(text: str) -> str:
    if text.strip() not in ("json", "text"):
        raise ValueError("must be json or text")
    return text.strip()


def _non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], object]
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "bind",
        "127.0.0.1:4437",
        _non_empty,
        "Address gunicorn listens on (4437 is the protocol's default port).",
    ),
    Setting(
        "workers",
        "1",
        _positive_int,
        "gunicorn worker processes; one gevent worker per core is plenty (see README).",
    ),
    Setting(
        "storage_url",
        "./data",
        _non_empty,
        "Where streams are stored: a local directory or an fsspec URL such as s3://bucket/prefix.",
    ),
    Setting(
        "long_poll_timeout",
        "20",
        _positive_float,
        "Seconds a long-poll read waits for new data before answering 204 (fractions allowed).",
    ),
    Setting(
        "sse_max_duration",
        "60",
        _positive_float,
        "Seconds after which an SSE response ends so clients reconnect (lets caches collapse).",
    ),
    Setting(
        "max_request_bytes",
        str(16 * 1024 * 1024),
        _positive_int,
        "Largest request body accepted, in bytes; larger bodies get 413.",
    ),
    Setting(
        "max_read_bytes",
        str(4 * 1024 * 1024),
        _positive_int,
        "Most bytes of stream data in one catch-up response; Stream-Next-Offset continues it.",
    ),
    Setting(
        "cache_bytes",
        str(64 * 1024 * 1024),
        _positive_int,
        "Bytes of recently written or read segments each worker keeps in memory.",
    ),
    Setting(
        "retention_age",
        "none",
        _optional_positive_int,
        "Default for streams created without Stream-Retention-Age: seconds data is kept.",
    ),
    Setting(
        "retention_bytes",
        "none",
        _optional_positive_int,
        "Default for streams created without Stream-Retention-Bytes: bytes kept per stream.",
    ),
    Setting(
        "index_max_age",
        "60",
        _positive_float,
        "Seconds a cached stream index may age before it is re-listed; trimmed and compacted"
        " objects are deleted ten times this long after they leave every index.",
    ),
    Setting(
        "poll_interval",
        "auto",
        _auto_or_positive_float,
        "Seconds between checks for appends made by other processes while readers wait"
        " (auto: 0.05 on local disk, 1 on object stores, where each check is a request).",
    ),
    Setting(
        "log_format",
        "json",
        _log_format,
        "json: one JSON object per log line, with the request id; text: plain lines.",
    ),
)


@dataclass(frozen=True)
class Settings:
    """Validated values; build with `from_environment` so defaults live only in SETTINGS."""

    bind: str
    workers: int
    storage_url: str
    long_poll_timeout: float
    sse_max_duration: float
    max_request_bytes: int
    max_read_bytes: int
    cache_bytes: int
    retention_age: int | None
    retention_bytes: int | None
    index_max_age: float
    poll_interval: float | None
    log_format: str

    @staticmethod
    def from_environment(environment: Mapping[str, str] = os.environ) -> Settings:
        values: dict[str, object] = {}
        for setting in SETTINGS:
            variable = f"PICOMQ_{setting.name.upper()}"
            text = environment.get(variable, setting.default)
            try:
                values[setting.name] = setting.parse(text)
            except ValueError as error:
                raise SettingsError(f"{variable}={text!r}: {error}") from error
        return Settings(**values)


assert [setting.name for setting in SETTINGS] == [field.name for field in fields(Settings)]
