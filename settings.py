"""Every setting PicoMQ reads, declared once: name, default, validation and meaning.

Settings come from `PICOMQ_*` environment variables and are validated at start, so
a typo fails the boot with a message instead of a request with a 500. The table in
docs/settings.md is checked against `SETTINGS` by the tests.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

MIN_JWT_SECRET_BYTES = 32  # HS256: a key at least as long as the hash (RFC 7518 3.2)
MIN_RSA_KEY_BITS = 2048
MAX_JSON_DEPTH = 200  # well below the 1,000 levels at which msgspec stops parsing
MAX_REQUEST_BYTES = 1024**3  # a segment's positions are u32 (segments.py)
MAX_KEYS = 8  # verification keys at once: the ones in use, and those being rotated in or out
KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError("must be 0 (off) or a positive number")
    return value


def _auto_or_non_negative_float(text: str) -> float | None:
    return None if text.strip() == "auto" else _non_negative_float(text)


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


def _request_bytes(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_REQUEST_BYTES:
        raise ValueError(f"must be at most {MAX_REQUEST_BYTES}")
    return value


def _json_depth(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_JSON_DEPTH:
        raise ValueError(f"must be at most {MAX_JSON_DEPTH}")
    return value


def _optional_text(text: str) -> str | None:
    return text.strip() or None


@dataclass(frozen=True)
class NamedKey:
    """One key that verifies tokens, and the id (`kid`) tokens name it by: None in the
    single-key form, where a token's kid is not looked at."""

    kid: str | None
    text: str  # an HS256 secret, or a public key's PEM text


def parse_key_set(text: str, parse_key: Callable[[str], str]) -> tuple[NamedKey, ...]:
    """One key, or a set of them: a value that starts with `{` is a JSON object of key
    ids to keys (`{"2026-05": "…", "2026-01": "…"}`), at most MAX_KEYS, whose first key
    also verifies tokens that name none. Each key goes through `parse_key`.

    Error messages name key ids, never a key, so that secrets stay out of the logs.
    """
    if not text:
        return ()
    if not text.lstrip().startswith("{"):
        return (NamedKey(None, parse_key(text)),)
    try:
        pairs = json.loads(text, object_pairs_hook=list)
    except ValueError:
        raise ValueError("starts with { but is not a JSON object of key ids to keys") from None
    if not 1 <= len(pairs) <= MAX_KEYS:
        raise ValueError(f"must name 1 to {MAX_KEYS} keys")
    if len({kid for kid, _ in pairs}) != len(pairs):
        raise ValueError("names a key id twice")
    keys = []
    for kid, key in pairs:
        if not KEY_ID.fullmatch(kid):
            raise ValueError(f"key ids are 1 to 64 of A-Z a-z 0-9 . _ - (not {kid!r})")
        if not isinstance(key, str):
            raise ValueError(f"key {kid}: must be a JSON string")
        try:
            keys.append(NamedKey(kid, parse_key(key)))
        except ValueError as error:
            raise ValueError(f"key {kid}: {error}") from None
    return tuple(keys)


def _jwt_secret(text: str) -> str:
    if len(text.encode()) < MIN_JWT_SECRET_BYTES:
        raise ValueError(f"must be at least {MIN_JWT_SECRET_BYTES} bytes")
    return text


def _jwt_secrets(text: str) -> tuple[NamedKey, ...]:
    return parse_key_set(text, _jwt_secret)


def read_pem(text: str) -> str:
    """A key as PEM text: `text` itself, or the file it names (OSError if unreadable).

    Keys are given either way, in settings and to the token command alike."""
    return text if text.lstrip().startswith("-----BEGIN") else Path(text.strip()).read_text()


def _public_key(text: str) -> str:
    """PEM text, or the path of a PEM file; an Ed25519 or RSA (2048 bits or more) public key."""
    try:
        pem = read_pem(text)
        key = load_pem_public_key(pem.encode())
    except (OSError, ValueError, UnsupportedAlgorithm) as error:
        raise ValueError(f"not a readable PEM public key ({type(error).__name__})") from error
    if isinstance(key, RSAPublicKey) and key.key_size >= MIN_RSA_KEY_BITS:
        return pem
    if isinstance(key, Ed25519PublicKey):
        return pem
    raise ValueError(f"must be an Ed25519 key or an RSA key of {MIN_RSA_KEY_BITS} bits or more")


def _public_keys(text: str) -> tuple[NamedKey, ...]:
    return parse_key_set(text, _public_key)


def _networks(text: str) -> tuple[Network, ...]:
    """Comma-separated CIDR blocks (`127.0.0.0/8,::1`); host bits set are masked off."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    return tuple(ipaddress.ip_network(item, strict=False) for item in items)


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], object]
    doc: str
    secret: bool = False  # never echo the value, even in an error


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
        "gunicorn worker processes; one gevent worker per core is plenty (docs/operations.md).",
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
        "body_timeout",
        "30",
        _positive_float,
        "Seconds a request body may take to arrive whole after its head; past them the"
        " request gets 400 and its connection closes.",
    ),
    Setting(
        "write_timeout",
        "30",
        _positive_float,
        "Seconds one write of a response may wait for the client to take it; past them"
        " the connection closes.",
    ),
    Setting(
        "max_request_bytes",
        str(16 * 1024 * 1024),
        _request_bytes,
        f"Largest request body accepted, in bytes (at most {MAX_REQUEST_BYTES});"
        " larger bodies get 413.",
    ),
    Setting(
        "max_append_messages",
        "100000",
        _positive_int,
        "Most messages in one JSON append (the items of its array); more gets 413.",
    ),
    Setting(
        "max_read_bytes",
        str(4 * 1024 * 1024),
        _positive_int,
        "Most bytes of stream data in one catch-up response; Stream-Next-Offset continues it.",
    ),
    Setting(
        "max_json_depth",
        "128",
        _json_depth,
        "Deepest nesting of arrays and objects in a JSON body (the outer array counts);"
        " deeper gets 400.",
    ),
    Setting(
        "max_header_bytes",
        "8190",
        _positive_int,
        "Longest request header line accepted, in bytes; longer gets a 431.",
    ),
    Setting(
        "max_headers",
        "100",
        _positive_int,
        "Most header fields in one request; more gets a 431.",
    ),
    Setting(
        "max_live_connections",
        "20000",
        _positive_int,
        "Long-poll and SSE reads each worker serves at once; one more gets 503 with Retry-After.",
    ),
    Setting(
        "jwt_secret",
        "",
        _jwt_secrets,
        "HS256 key (32 bytes or more) that turns access control on, or a JSON object of key"
        " ids (kid) to keys; empty: off (docs/security.md).",
        secret=True,
    ),
    Setting(
        "jwt_public_key",
        "",
        _public_keys,
        "Ed25519 or RSA public key, PEM text or a PEM file's path, that turns access control"
        " on, or a JSON object of key ids (kid) to such keys.",
    ),
    Setting(
        "jwt_audience",
        "",
        _optional_text,
        "When set, tokens must carry this aud claim; empty: aud is not checked.",
    ),
    Setting(
        "revocation_interval",
        "5",
        _non_negative_float,
        "Seconds, plus one storage listing, within which every worker and node refuses a"
        " revoked token (each lists the revocations once per interval while it serves"
        " tokens); 0: revocations are not checked.",
    ),
    Setting(
        "webhook_allowed_networks",
        "",
        _networks,
        "Comma-separated networks (such as 127.0.0.0/8,10.0.0.0/8) webhooks may reach, by"
        " http or https; empty: only public addresses, by https (docs/security.md).",
    ),
    Setting(
        "webhook_timeout",
        "30",
        _positive_float,
        "Seconds one webhook delivery attempt may take in all, from resolving the host to"
        " the end of the reply; then it counts as failed and is retried.",
    ),
    Setting(
        "peer_host",
        "127.0.0.1",
        _non_empty,
        "Address each worker's peer listener binds to and gives the others, which forward"
        " there the requests for the streams it serves; nodes on one bucket must reach it.",
    ),
    Setting(
        "lease_seconds",
        "10",
        _positive_float,
        "Seconds after its last heartbeat that a member's streams may be taken over by"
        " another; a heartbeat goes every third of it while the member serves.",
    ),
    Setting(
        "log_linger",
        "auto",
        _auto_or_non_negative_float,
        "Seconds a flush of the member's log that finds it idle waits for other streams'"
        " commits to join it: more latency for a lone append, fewer objects written"
        " (auto: 0.005 on object stores, 0 on local disk).",
    ),
    Setting(
        "rewrite_seconds",
        "30",
        _positive_float,
        "Seconds a stream's commits stay in the member's log (and its memory) at most"
        " before they are rewritten into the stream's own segments; also at 4 MiB.",
    ),
    Setting(
        "log_held_bytes",
        str(256 * 1024 * 1024),
        _positive_int,
        "Bytes of commits not yet rewritten that each worker holds in memory; past"
        " it, every stream's are rewritten at once.",
    ),
    Setting(
        "cache_bytes",
        str(64 * 1024 * 1024),
        _positive_int,
        "Bytes of recently written or read segments each worker keeps in memory.",
    ),
    Setting(
        "index_cache_bytes",
        str(64 * 1024 * 1024),
        _positive_int,
        "Bytes of stream handles and segment indexes (message and append ends, producer"
        " tables) each worker keeps in memory; half for each.",
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
        " (auto: 0.05 on local disk, 1 on object stores, where each check is a request;"
        " 1 on local disk where inotify says when to check).",
    ),
    Setting(
        "sweep_interval",
        "auto",
        _auto_or_non_negative_float,
        "Seconds between sweeps that delete expired streams nobody opens any more,"
        " soft-deleted streams no fork reads any more and, on local disk, what writers"
        " racing deletes left (auto: 3600 on local disk, 0 (off) on object stores, where"
        " a sweep lists the bucket).",
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
    body_timeout: float
    write_timeout: float
    max_request_bytes: int
    max_append_messages: int
    max_read_bytes: int
    max_json_depth: int
    max_header_bytes: int
    max_headers: int
    max_live_connections: int
    jwt_secret: tuple[NamedKey, ...]
    jwt_public_key: tuple[NamedKey, ...]
    jwt_audience: str | None
    revocation_interval: float
    webhook_allowed_networks: tuple[Network, ...]
    webhook_timeout: float
    peer_host: str
    lease_seconds: float
    log_linger: float | None
    rewrite_seconds: float
    log_held_bytes: int
    cache_bytes: int
    index_cache_bytes: int
    retention_age: int | None
    retention_bytes: int | None
    index_max_age: float
    poll_interval: float | None
    sweep_interval: float | None
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
                shown = "(secret)" if setting.secret else repr(text)
                raise SettingsError(f"{variable}={shown}: {error}") from error
        if values["jwt_secret"] and values["jwt_public_key"]:
            raise SettingsError("set PICOMQ_JWT_SECRET or PICOMQ_JWT_PUBLIC_KEY, not both")
        return Settings(**values)

    @property
    def auth_enabled(self) -> bool:
        """Access control is on exactly when a key to verify tokens is configured."""
        return bool(self.jwt_secret or self.jwt_public_key)


assert [setting.name for setting in SETTINGS] == [field.name for field in fields(Settings)]
