"""Reserved subscription APIs under the stream root: `{root}/__ds/...`.

A subscription links streams (a glob pattern, explicit paths, or both) to one consumer
and remembers, per linked stream, the offset that consumer has acknowledged. When a
linked stream holds data past its acknowledged offset the subscription *wakes* the
consumer, one wake at a time:

- webhook: POST a signed notification to the subscription's URL. A `{"done": true}`
  reply acknowledges every tail the wake reported; otherwise the consumer acknowledges
  through `…/callback` with the token it was sent, before its lease runs out.
- pull-wake: append `{"type": "wake", …}` to a wake stream the application created; a
  worker `…/claim`s the wake (a lease and a token), `…/ack`s progress (a heartbeat; with
  `done` it ends the wake) and may `…/release` it.

Every wake has a generation number and an id; a callback, ack or release naming any
other wake than the current one is FENCED (409). When a wake ends (done, release, lease
expiry) and data is still pending, the next wake starts at once. Glob patterns match
whole path segments, as a token's grants do (auth.matches): `*` is one segment, `**` any
number (a `*` inside a segment matches within it). A subscription never links its own
wake stream.

With access control on (auth.py), a PUT needs besides `admin` on its path `read` on all
it links (its pattern within one read grant of the token, each explicit stream granted)
and `append` on its wake stream; POST …/streams needs `read` on the streams it adds;
GET and claim list only the linked streams the caller may read. Webhooks reach public
addresses by https, and PICOMQ_WEBHOOK_ALLOWED_NETWORKS by http too; each delivery
resolves the host, checks every address and connects to a checked one (webhooks.py).

Layout under the stream store's object root (every object is created once, never
rewritten; the highest-numbered marker wins where there are several):

    subscriptions/_keys/webhook-signing.json   Ed25519 private key and its kid (made once)
    subscriptions/_keys/token.key              HMAC key of callback and claim tokens
    subscriptions/<id>/config.json             the subscription; the commit point of PUT,
                                               deleted first by DELETE
    subscriptions/<id>/<incarnation>/links/<stream key>/path      the linked stream's path
    subscriptions/<id>/<incarnation>/links/<stream key>/explicit  linked explicitly
    subscriptions/<id>/<incarnation>/links/<stream key>/glob      linked by the pattern
    subscriptions/<id>/<incarnation>/links/<stream key>/acked/<offset>.<stream incarnation>
    subscriptions/<id>/<incarnation>/generations/<n>        wake n began (its id inside)
    subscriptions/<id>/<incarnation>/generations/<n>.ended  wake n ended: the commit
                                                            point of done and release

An acknowledged offset names the stream incarnation it belongs to, so a stream deleted
and created again is read from its start. The private key never leaves storage and this
process; `…/jwks.json` serves only the public half.

With several workers and nodes, one member serves each subscription (members.py): the
one that serves its key's partition (protocol.subscription_key). Every `__ds` request
about it is forwarded there (forwarding.py), so its wake in flight, lease, token and
retries live in one process, and a callback, ack, claim or release means the same
whichever worker or node receives it. Streams grow at their own members, which tell
the subscriptions that link them (`on_stream_changed`, directory.py, peers.py); the
tails a wake reports come from the streams' members too. A member that takes over a
subscription (its former member died, or paused past its lease) ends the wake that one
had in flight by creating its `.ended` marker, and the next generation's marker, before
it serves: the former member then completes nothing (its create of either fails), and
the new one starts a wake if data is pending, so every wake goes out at least once.
docs/subscriptions.md has the design, its costs and the designs not taken.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from urllib.parse import unquote

import gevent
import orjson
import urllib3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from flask import Flask, request
from gevent.lock import RLock

from auth import AuthError, bearer_credentials, matches, refusal, request_allows, request_covers
from directory import Directory, Entry, drop_change, name_change, put_change
from members import PARTITIONS, Membership, Owner, partition_of
from objectstore import ObjectStore, StorageUnavailable, read_or_create
from peers import Peers, PeerUnavailable
from protocol import (
    RESERVED_PREFIX,
    RETRY_AFTER_SECONDS,
    STREAM_PREFIX,
    BadRequest,
    Response,
    error_response,
    format_offset,
    is_reserved,
    json_response,
    parse_offset,
    subscription_key,
)
from protocol import parse_stream_path as parse_picomq_path
from settings import Network, Settings
from storage import StreamStore
from streams import (
    AppendRequest,
    Payload,
    StoreError,
    StreamConflict,
    StreamGone,
    StreamInfo,
    StreamNotFound,
    is_json_type,
    stream_key,
)
from webhooks import (
    MAX_DELIVERY_ATTEMPTS,
    WebhookTimedOut,
    WebhookUrlRejected,
    check_webhook_url,
    post_webhook,
    retry_delay,
)

log = logging.getLogger("picomq.subscriptions")

ROUTE_ROOT = f"{STREAM_PREFIX}{RESERVED_PREFIX}"
ALL_METHODS = ["GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"]
TYPES = ("webhook", "pull-wake")
BEFORE_FIRST = "-1"

DEFAULT_LEASE_TTL_MS = 30_000
MIN_LEASE_TTL_MS = 1_000
MAX_LEASE_TTL_MS = 600_000
TOKEN_TTL_SECONDS = 24 * 3600  # an outer bound only: a token is good while its wake is current
HEADS_PER_MESSAGE = 1000  # streams whose tails one peer message asks

MAX_BODY_BYTES = 1024 * 1024
MAX_STREAMS_PER_REQUEST = 1000
MAX_LINKS = 10_000
MAX_ACKS = 1000
MAX_DESCRIPTION_CHARS = 1024
MAX_WORKER_CHARS = 256
ENDED = ".ended"  # a wake generation's end marker: <generation>.ended
SUBSCRIPTION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,127}")


SIGNING_KEY_OBJECT = "subscriptions/_keys/webhook-signing.json"
TOKEN_KEY_OBJECT = "subscriptions/_keys/token.key"
JWK_SET_TYPE = "application/jwk-set+json"
SIGNATURE_HEADER = "Webhook-Signature"


# -- outcomes: each maps to one status and error code -------------------------------
# (and webhooks.WebhookUrlRejected, raised by the URL check: 400 WEBHOOK_URL_REJECTED)


class SubscriptionError(Exception):
    status = 400
    code = "INVALID_REQUEST"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.details = details


class BadSubscriptionRequest(SubscriptionError):
    """A subscription request the API refuses (400 INVALID_REQUEST); a stream request's
    400s are protocol.BadRequest and storage's InvalidRequest."""


class SubscriptionNotFound(SubscriptionError):
    status, code = 404, "SUBSCRIPTION_NOT_FOUND"


class SubscriptionExists(SubscriptionError):
    status, code = 409, "SUBSCRIPTION_ALREADY_EXISTS"


class TokenInvalid(SubscriptionError):
    status, code = 401, "TOKEN_INVALID"


class TokenExpired(SubscriptionError):
    status, code = 401, "TOKEN_EXPIRED"


class Fenced(SubscriptionError):
    status, code = 409, "FENCED"


class TakenOver(Fenced):
    """Another server took the subscription over (members.py): this process's wake is
    over, and it serves the subscription no more."""


class AlreadyClaimed(SubscriptionError):
    status, code = 409, "ALREADY_CLAIMED"


class NoPendingWork(SubscriptionError):
    status, code = 409, "NO_PENDING_WORK"


class InvalidOffset(SubscriptionError):
    status, code = 409, "INVALID_OFFSET"


class MethodNotAllowed(SubscriptionError):
    status, code = 405, "METHOD_NOT_ALLOWED"


# -- requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What a PUT asks for, normalised; two PUTs are the same iff their digests are."""

    type: str
    pattern: str | None
    streams: tuple[str, ...]
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    def digest(self) -> str:
        return hashlib.sha256(orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True)
class AckRequest:
    wake_id: str
    generation: int
    acks: tuple[tuple[str, str], ...] = ()
    done: bool = False


def parse_json_object(data: bytes) -> dict:
    if len(data) > MAX_BODY_BYTES:
        raise BadSubscriptionRequest(f"body is larger than {MAX_BODY_BYTES} bytes")
    if not data.strip():
        return {}
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise BadSubscriptionRequest("body is not valid JSON") from error
    if not isinstance(value, dict):
        raise BadSubscriptionRequest("body must be a JSON object")
    return value


def parse_subscription_id(text: str) -> str:
    if SUBSCRIPTION_ID.fullmatch(text) is None:
        raise BadSubscriptionRequest(
            "subscription id: 1-128 of A-Z a-z 0-9 . _ ~ -, not starting . _ ~ -"
        )
    return text


def parse_path(value: object, name: str) -> str:
    """A stream path (or pattern) relative to the root; slashes at either end are dropped."""
    if not isinstance(value, str) or not value.strip("/"):
        raise BadSubscriptionRequest(f"{name} must be a non-empty path")
    path = value.strip("/")
    try:
        parse_picomq_path(path)
    except BadRequest as error:
        raise BadSubscriptionRequest(f"{name}: {error}") from error
    if is_reserved(path):
        raise BadSubscriptionRequest(f"{name}: paths under {RESERVED_PREFIX}/ are reserved")
    return path


def parse_paths(value: object, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STREAMS_PER_REQUEST:
        raise BadSubscriptionRequest(
            f"{name} must be a list of at most {MAX_STREAMS_PER_REQUEST} paths"
        )
    return tuple(sorted({parse_path(item, name) for item in value}))


def parse_lease_ttl(value: object) -> int:
    if value is None:
        return DEFAULT_LEASE_TTL_MS
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not MIN_LEASE_TTL_MS <= value <= MAX_LEASE_TTL_MS:
        raise BadSubscriptionRequest(
            f"lease_ttl_ms must be an integer from {MIN_LEASE_TTL_MS} to {MAX_LEASE_TTL_MS}"
        )
    return value


def parse_spec(body: dict) -> Spec:
    """Validate a PUT body; fields that do not apply to the type are ignored."""
    kind = body.get("type")
    if kind not in TYPES:
        raise BadSubscriptionRequest('type must be "webhook" or "pull-wake"')
    pattern = None if body.get("pattern") in (None, "") else parse_path(body["pattern"], "pattern")
    streams = parse_paths(body.get("streams"), "streams")
    if pattern is None and not streams:
        raise BadSubscriptionRequest("give a pattern, streams, or both")
    webhook_url = wake_stream = None
    if kind == "webhook":
        webhook = body.get("webhook")
        webhook_url = webhook.get("url") if isinstance(webhook, dict) else None
        if not isinstance(webhook_url, str) or not webhook_url:
            raise BadSubscriptionRequest("webhook subscriptions need webhook.url")
    else:
        wake_stream = parse_path(body.get("wake_stream"), "wake_stream")
        if wake_stream in streams:
            raise BadSubscriptionRequest("a subscription cannot link its own wake stream")
    description = body.get("description")
    if description is not None and (
        not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS
    ):
        raise BadSubscriptionRequest(
            f"description must be a string of at most {MAX_DESCRIPTION_CHARS}"
        )
    lease_ttl_ms = parse_lease_ttl(body.get("lease_ttl_ms"))
    return Spec(kind, pattern, streams, webhook_url, wake_stream, lease_ttl_ms, description)


def parse_worker(body: dict) -> str:
    worker = body.get("worker")
    if not isinstance(worker, str) or not worker or len(worker) > MAX_WORKER_CHARS:
        raise BadSubscriptionRequest(
            f"worker must be a non-empty string of at most {MAX_WORKER_CHARS}"
        )
    return worker


def parse_ack_request(body: dict) -> AckRequest:
    wake_id, generation = body.get("wake_id"), body.get("generation")
    if not isinstance(wake_id, str) or type(generation) is not int:
        raise BadSubscriptionRequest(
            "give the wake_id (string) and generation (integer) of the wake"
        )
    raw_acks, done = body.get("acks", []), body.get("done", False)
    if not isinstance(raw_acks, list) or len(raw_acks) > MAX_ACKS:
        raise BadSubscriptionRequest(f"acks must be a list of at most {MAX_ACKS}")
    if not isinstance(done, bool):
        raise BadSubscriptionRequest("done must be true or false")
    acks = []
    for ack in raw_acks:
        if not isinstance(ack, dict) or not isinstance(ack.get("offset"), str):
            raise BadSubscriptionRequest('each ack is {"stream": path, "offset": offset}')
        acks.append((parse_path(ack.get("stream", ack.get("path")), "ack stream"), ack["offset"]))
    return AckRequest(wake_id, generation, tuple(acks), done)


def wake_token() -> str:
    """The wake's token, which a callback, ack or release carries as a bearer token."""
    token = bearer_credentials(request.headers.get("Authorization", ""))
    if not token:
        raise TokenInvalid("send the wake's token as Authorization: Bearer <token>")
    return token


# -- keys: webhook signatures and wake tokens -------------------------------------------


def encode_base64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def decode_base64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class WebhookSigner:
    """Ed25519 signatures over `<unix seconds>.<body>`; the kid is the RFC 7638 thumbprint."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        public = private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.x = encode_base64url(public)
        thumbprint = orjson.dumps({"crv": "Ed25519", "kty": "OKP", "x": self.x})
        self.kid = "ds_" + encode_base64url(hashlib.sha256(thumbprint).digest())

    def jwk(self) -> dict[str, str]:
        return {"kty": "OKP", "crv": "Ed25519", "kid": self.kid, "use": "sig", "alg": "EdDSA",
                "x": self.x}  # fmt: skip

    def sign(self, body: bytes, timestamp: int) -> str:
        signature = self._private_key.sign(f"{timestamp}.".encode() + body)
        return f"t={timestamp},kid={self.kid},ed25519={encode_base64url(signature)}"


class WakeTokens:
    """Bearer tokens naming one wake: base64url(claims).base64url(HMAC-SHA256)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def issue(self, subscription: Subscription, wake: Wake) -> str:
        claims = {"sub": subscription.id, "inc": subscription.record.incarnation,
                  "gen": wake.generation, "wake": wake.id,
                  "exp": int(time.time()) + TOKEN_TTL_SECONDS}  # fmt: skip
        payload = encode_base64url(orjson.dumps(claims))
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str, subscription: Subscription) -> dict:
        """The token's claims; TokenInvalid or TokenExpired unless it is ours and current."""
        payload, _, mac = token.partition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            raise TokenInvalid("token is not valid for this server")
        claims = orjson.loads(decode_base64url(payload))
        if (claims["sub"], claims["inc"]) != (subscription.id, subscription.record.incarnation):
            raise TokenInvalid("token belongs to another subscription")
        if claims["exp"] < time.time():
            raise TokenExpired("token expired")
        return claims

    def _mac(self, payload: str) -> str:
        return encode_base64url(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())


# -- what a subscription holds ---------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """config.json: the spec plus what the server chose when it created the subscription."""

    id: str
    incarnation: str
    created_at: str
    root_url: str  # `{root}` as the creating request saw it: callback and JWKS URLs use it
    spec: Spec

    @property
    def prefix(self) -> str:
        return f"subscriptions/{self.id}/{self.incarnation}"

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @staticmethod
    def from_json(data: bytes) -> Record:
        fields = orjson.loads(data)
        spec = fields.pop("spec")
        spec["streams"] = tuple(spec["streams"])
        return Record(**fields, spec=Spec(**spec))


@dataclass(frozen=True)
class Ack:
    """An acknowledged position in one incarnation of a stream."""

    incarnation: str
    position: int

    @property
    def marker(self) -> str:
        return f"{self.position:020d}.{self.incarnation}"

    @staticmethod
    def from_marker(name: str) -> Ack | None:
        position, _, incarnation = name.partition(".")
        return Ack(incarnation, int(position)) if position.isdigit() and incarnation else None


@dataclass
class Link:
    path: str
    explicit: bool = False
    glob: bool = False
    acked: Ack | None = None

    @property
    def link_type(self) -> str:
        return "explicit" if self.explicit else "glob"

    def describe(self) -> dict[str, str]:
        acked = format_offset(self.acked.position) if self.acked else BEFORE_FIRST
        return {"path": self.path, "link_type": self.link_type, "acked_offset": acked}


@dataclass(frozen=True)
class LinkState:
    """A link against its stream's current tail (tail None: the stream does not exist)."""

    link: Link
    tail: Ack | None

    @property
    def acked(self) -> Ack | None:
        acked = self.link.acked
        if acked is None or self.tail is None or acked.incarnation != self.tail.incarnation:
            return None
        return acked

    @property
    def pending(self) -> bool:
        return self.tail is not None and self.tail.position > (
            self.acked.position if self.acked else 0
        )

    def describe(self) -> dict[str, object]:
        return {
            "path": self.link.path,
            "link_type": self.link.link_type,
            "acked_offset": format_offset(self.acked.position) if self.acked else BEFORE_FIRST,
            "tail_offset": format_offset(self.tail.position if self.tail else 0),
            "has_pending": self.pending,
        }


@dataclass(eq=False)
class Wake:
    id: str
    generation: int
    states: list[LinkState]  # the links as the wake saw them; `done` acknowledges these tails
    token: str = ""
    holder: str | None = None
    lease: gevent.Greenlet | None = None
    lease_expires: float = float("inf")

    @property
    def leased(self) -> bool:
        return self.holder is not None and time.monotonic() < self.lease_expires


@dataclass(eq=False)
class Subscription:
    record: Record
    links: dict[str, Link]
    generation: int
    wake: Wake | None = None
    status: str = "active"
    retired: bool = False  # this process serves it no more: deleted, or served elsewhere
    lock: RLock = field(default_factory=RLock)
    pattern: tuple[str, ...] | None = None  # the glob's segments, as auth.matches takes them

    def __post_init__(self) -> None:
        if self.spec.pattern is not None:
            self.pattern = tuple(self.spec.pattern.split("/"))

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def spec(self) -> Spec:
        return self.record.spec

    def matches(self, path: str) -> bool:
        if path == self.spec.wake_stream or self.pattern is None:
            return False
        return matches(self.pattern, tuple(path.split("/")))


# -- storage of subscriptions ----------------------------------------------------------


class SubscriptionObjects:
    """The layout in the module docstring, over create-only objects."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    @staticmethod
    def config_key(subscription_id: str) -> str:
        return f"subscriptions/{subscription_id}/config.json"

    def ids(self) -> list[str]:
        return [name for name in self.objects.list("subscriptions") if not name.startswith("_")]

    def read_record(self, subscription_id: str) -> Record | None:
        try:
            return Record.from_json(self.objects.read(self.config_key(subscription_id)))
        except FileNotFoundError:
            return None

    def create_record(self, record: Record) -> None:
        """The commit point of a PUT; FileExistsError if the id is taken."""
        self.objects.create(self.config_key(record.id), record.to_json())

    def delete(self, record: Record) -> None:
        current = self.read_record(record.id)
        if current is not None and current.incarnation == record.incarnation:
            self.objects.delete(self.config_key(record.id))  # the commit point of a DELETE
        self.objects.delete_tree(record.prefix)

    # -- links and acknowledgements --

    @staticmethod
    def link_prefix(record: Record, path: str) -> str:
        return f"{record.prefix}/links/{stream_key(path)}"

    def write_link(self, record: Record, link: Link) -> None:
        prefix = self.link_prefix(record, link.path)
        names = ["path"] + [kind for kind in ("explicit", "glob") if getattr(link, kind)]
        for name in names:
            self._create_once(f"{prefix}/{name}", link.path.encode() if name == "path" else b"")
        if link.acked is not None:
            self._create_once(f"{prefix}/acked/{link.acked.marker}", b"")

    def remove_explicit(self, record: Record, path: str) -> None:
        self._delete_once(f"{self.link_prefix(record, path)}/explicit")

    def remove_link(self, record: Record, path: str) -> None:
        self.objects.delete_tree(self.link_prefix(record, path))

    def write_ack(self, record: Record, path: str, ack: Ack, previous: Ack | None) -> None:
        prefix = f"{self.link_prefix(record, path)}/acked"
        self._create_once(f"{prefix}/{ack.marker}", b"")
        if previous is not None and previous != ack:
            self._delete_once(f"{prefix}/{previous.marker}")

    def read_links(self, record: Record) -> dict[str, Link]:
        links = {}
        for key in self.objects.list(f"{record.prefix}/links"):
            prefix = f"{record.prefix}/links/{key}"
            names = set(self.objects.list(prefix))
            if "path" not in names or not names & {"explicit", "glob"}:
                continue
            try:
                path = self.objects.read(f"{prefix}/path").decode()
            except FileNotFoundError:  # unlinked while we listed
                continue
            markers = (Ack.from_marker(name) for name in self.objects.list(f"{prefix}/acked"))
            acked = max(filter(None, markers), key=lambda ack: ack.position, default=None)
            links[path] = Link(path, "explicit" in names, "glob" in names, acked)
            if key != stream_key(path):  # an older release's name for a long path: move it
                self.write_link(record, links[path])
                self.objects.delete_tree(prefix)
        return links

    # -- the directory (directory.py) --

    def directory_entries(self, known: dict[str, Entry]) -> dict[str, Entry]:
        """Every subscription as the directory holds it. One listing of everything under
        subscriptions/; then the config of each subscription not in `known`, or known by
        an incarnation whose folder is gone (or never made: one that links nothing), and
        the path of each named link whose key does not spell it."""
        configs: set[str] = set()
        folders: dict[str, set[str]] = defaultdict(set)
        named: dict[tuple[str, str], set[str]] = defaultdict(set)
        for name in self.objects.list_tree("subscriptions"):
            parts = name.split("/")
            if parts[0].startswith("_"):
                continue
            if parts[1:] == ["config.json"]:
                configs.add(parts[0])
            elif len(parts) > 2:
                folders[parts[0]].add(parts[1])
                if len(parts) == 5 and parts[2] == "links" and parts[4] == "explicit":
                    named[(parts[0], parts[1])].add(parts[3])
        entries = {}
        for subscription_id in configs:
            entry = known.get(subscription_id)
            if entry is None or entry.incarnation not in folders[subscription_id]:
                record = self.read_record(subscription_id)
                if record is None:
                    continue
                entry = entry_of(record, frozenset())
            spelled = {stream_key(path): path for path in entry.named}
            keys = named.get((entry.id, entry.incarnation), set())
            paths = {spelled.get(key) or self._linked_path(entry, key) for key in keys}
            entries[subscription_id] = replace(entry, named=frozenset(paths - {None}))
        return entries

    def _linked_path(self, entry: Entry, key: str) -> str | None:
        path = unquote(key)
        if stream_key(path) == key:
            return path
        try:
            key_path = f"subscriptions/{entry.id}/{entry.incarnation}/links/{key}/path"
            return self.objects.read(key_path).decode()
        except FileNotFoundError:  # unlinked while we listed
            return None

    # -- generations: which process starts and ends wakes --

    def take_over(self, record: Record, token: str) -> int:
        """Begin to serve the subscription; returns its generation (the next wake's is one
        more). A former server may have a wake in flight (it died, or paused past its
        lease): its `.ended` marker is created here, and the next generation's marker, so
        that server can neither complete its wake nor start another, whatever the clocks
        say: both are creates of those names (`end_generation`, `start_generation`)."""
        latest, names = self._generations(record)
        while True:
            if latest:
                self._create_once(f"{self._generation_key(record, latest)}{ENDED}", token.encode())
            try:
                self.objects.create(self._generation_key(record, latest + 1), token.encode())
            except FileExistsError:  # that server began one meanwhile: end it too
                latest += 1
                continue
            ended = {f"{latest:020d}{ENDED}"} if latest else set()
            self._delete_below(record, latest + 1, names | ended)
            return latest + 1

    def start_generation(self, record: Record, previous: int, wake_id: str) -> int:
        """Create the marker of wake `previous` + 1, naming it. Raises TakenOver when
        another server made that marker, or a later one: it took the subscription over."""
        generation = previous + 1
        self._create_mine(self._generation_key(record, generation), wake_id)
        latest, names = self._generations(record)  # a marker deleted as old and made again
        if latest > generation:
            raise TakenOver("another server took this subscription over")
        self._delete_below(record, generation, names)
        return generation

    def end_generation(self, record: Record, generation: int, wake_id: str) -> None:
        """The commit point of a wake's end. Raises TakenOver when a new server ended it
        first (`take_over`), or has begun a later one."""
        self._create_mine(f"{self._generation_key(record, generation)}{ENDED}", wake_id)
        latest, _ = self._generations(record)
        if latest > generation:
            raise TakenOver("another server took this subscription over")

    @staticmethod
    def _generation_key(record: Record, generation: int) -> str:
        return f"{record.prefix}/generations/{generation:020d}"

    def _generations(self, record: Record) -> tuple[int, set[str]]:
        names = set(self.objects.list(f"{record.prefix}/generations"))
        return max((int(name) for name in names if name.isdigit()), default=0), names

    def _delete_below(self, record: Record, generation: int, names: set[str]) -> None:
        old = [name for name in names if name[:20].isdigit() and int(name[:20]) < generation]
        self.objects.delete_many([f"{record.prefix}/generations/{name}" for name in old])

    def _create_mine(self, key: str, token: str) -> None:
        """Create `key` holding `token`; one there already is ours only if it holds it (a
        create whose answer was lost). Raises TakenOver for another's."""
        try:
            self.objects.create(key, token.encode())
        except FileExistsError:
            try:
                mine = self.objects.read(key) == token.encode()
            except FileNotFoundError:
                mine = False
            if not mine:
                raise TakenOver("another server took this subscription over") from None

    def _create_once(self, key: str, data: bytes) -> None:
        try:
            self.objects.create(key, data)
        except FileExistsError:
            pass

    def _delete_once(self, key: str) -> None:
        try:
            self.objects.delete(key)
        except FileNotFoundError:
            pass


# -- the subscriptions this member serves ----------------------------------------------


class Subscriptions:
    """Create, read, delete and link subscriptions; wake consumers; take their acks; and
    tell the subscriptions that link the streams this member commits.

    This member holds the subscriptions it serves (members.py), each loaded on first use:
    while it serves one, no other process changes it, so what it holds is the truth.
    State changes of one subscription happen under its lock; the lock is never held
    across a webhook POST (deliveries run in their own greenlet).
    """

    def __init__(
        self,
        store: StreamStore,
        membership: Membership,
        peers: Peers,
        webhook_networks: tuple[Network, ...],
        webhook_timeout: float,
    ) -> None:
        self.store = store
        self.membership = membership
        self.peers = peers
        self.webhook_networks = webhook_networks  # reachable besides public addresses
        self.webhook_timeout = webhook_timeout  # seconds for one delivery attempt, in all
        self.files = SubscriptionObjects(store.objects)
        self.directory = Directory(self.files.directory_entries)
        self.directory.on_learn = self._tell_held
        self._subscriptions: dict[str, Subscription] = {}
        self._registry_lock = RLock()
        self._news: dict[str, dict[str, Ack]] = {}  # per subscription, tails to tell it
        self._telling: set[str] = set()  # subscriptions a greenlet is telling
        self._to_wake: set[int] | None = None  # partitions whose subscriptions to wake
        self._signer: WebhookSigner | None = None
        self._tokens: WakeTokens | None = None

    # -- keys --

    @property
    def signer(self) -> WebhookSigner:
        if self._signer is None:
            data = read_or_create(self.files.objects, SIGNING_KEY_OBJECT, _new_signing_key)
            key = Ed25519PrivateKey.from_private_bytes(decode_base64url(orjson.loads(data)["d"]))
            self._signer = WebhookSigner(key)
        return self._signer

    @property
    def tokens(self) -> WakeTokens:
        if self._tokens is None:
            make = lambda: secrets.token_bytes(32)  # noqa: E731
            self._tokens = WakeTokens(read_or_create(self.files.objects, TOKEN_KEY_OBJECT, make))
        return self._tokens

    def jwks(self) -> dict:
        return {"keys": [self.signer.jwk()]}

    # -- the subscriptions served here --

    def find(self, subscription_id: str) -> Subscription | None:
        """The subscription as this member serves it, loaded from storage on first use:
        loading takes it over (`SubscriptionObjects.take_over`)."""
        current = self._subscriptions.get(subscription_id)
        if current is not None:
            return current
        with self._registry_lock:
            current = self._subscriptions.get(subscription_id)
            if current is not None:
                return current
            record = self.files.read_record(subscription_id)
            if record is None:
                return None
            generation = self.files.take_over(record, self.membership.member)
            loaded = Subscription(record, self.files.read_links(record), generation)
            self._subscriptions[subscription_id] = loaded
            return loaded

    def require(self, subscription_id: str) -> Subscription:
        subscription = self.find(parse_subscription_id(subscription_id))
        if subscription is None:
            raise SubscriptionNotFound(f"subscription {subscription_id} not found")
        return subscription

    def busy(self) -> bool:
        """Whether a wake is out that this member must go on serving until it ends (a
        webhook delivered or leased, a pull wake claimed): its heartbeat goes on."""
        return any(
            subscription.wake is not None
            and (subscription.spec.type == "webhook" or subscription.wake.holder is not None)
            for subscription in self._subscriptions.values()
        )

    def resume(self) -> None:
        """Once a member (Membership.on_start): serve every subscription nobody serves or
        whose server is dead, and wake those with data pending, so what a process that
        died mid-wake left goes out again."""
        self._wake_partitions(set(range(PARTITIONS)))

    def partition_changed(self, partition: int, ours: bool) -> None:
        """Membership.on_change (which must not wait): this member begins or ends serving
        `partition`. What it held of the partition's subscriptions may be stale either
        way: retired now (a request loads one anew). Beginning, it reads the directory
        again before it tells of its next commit, and wakes the partition's
        subscriptions that have data pending."""
        for subscription in list(self._subscriptions.values()):
            if partition_of(subscription_key(subscription.id)) == partition:
                self._subscriptions.pop(subscription.id, None)
                subscription.retired = True
                gevent.spawn(self._drop_wake, subscription)
        if ours:
            self.directory.stale = True
            gevent.spawn(self._wake_partitions, {partition})

    def _wake_partitions(self, partitions: set[int]) -> None:
        """Wake the subscriptions of `partitions` this member serves (claiming those
        nobody serves); partitions added meanwhile join this greenlet's next round, each
        round one listing of the subscriptions."""
        if self._to_wake is not None:
            self._to_wake |= partitions
            return
        self._to_wake = set(partitions)
        try:
            while self._to_wake:
                partitions, self._to_wake = self._to_wake, set()
                for subscription_id in self.files.ids():
                    if partition_of(subscription_key(subscription_id)) in partitions:
                        self._wake_served(subscription_id)
        except StorageUnavailable as error:
            log.warning("pending wakes not resumed (the next request for each resumes it): %s",
                        error)  # fmt: skip
        finally:
            self._to_wake = None

    def _wake_served(self, subscription_id: str) -> None:
        try:  # one subscription that fails never keeps the others asleep
            if self.membership.known_owner(subscription_key(subscription_id)) is not None:
                return
            subscription = self.find(subscription_id)
            if subscription is not None:
                with subscription.lock:
                    self._try_next_wake(subscription)
        except Exception:
            log.exception("subscription %s could not resume its wake", subscription_id)

    def _still_serves(self, subscription: Subscription) -> bool:
        """Whether this member still serves `subscription`, asked before a timer acts on
        it: a paused process may have lost it meanwhile (then it is retired:
        `partition_changed`). Storage that cannot say means no, for now."""
        if subscription.retired:
            return False
        try:
            owner = self.membership.owner_for(subscription_key(subscription.id))
        except StorageUnavailable:
            return False
        return owner is None and not subscription.retired

    def _retire(self, subscription: Subscription) -> None:
        """This process no longer serves `subscription` (deleted, or another took it over)."""
        with subscription.lock:
            subscription.retired = True
            self._end_wake(subscription)
        if self._subscriptions.get(subscription.id) is subscription:
            del self._subscriptions[subscription.id]

    def _drop_wake(self, subscription: Subscription) -> None:
        with subscription.lock:
            self._end_wake(subscription)

    def _publish(self, change: dict) -> None:
        """Tell the directory here and at every member that serves streams (directory.py)."""
        self.directory.apply(change)
        self.peers.tell_all("directory", change)

    # -- PUT, GET, DELETE --

    def create(self, subscription_id: str, spec: Spec, root_url: str) -> tuple[bool, Subscription]:
        """Create, or confirm an identical subscription: returns (created, subscription)."""
        existing = self.find(subscription_id)
        if existing is not None:
            return False, self._confirm(existing, spec)
        if spec.type == "webhook":
            check_webhook_url(spec.webhook_url or "", self.webhook_networks)
        record = Record(
            subscription_id, uuid.uuid4().hex[:16], datetime.now(UTC).isoformat(), root_url, spec
        )
        links = self._initial_links(spec)
        # Links first, under a fresh incarnation, then config.json: until that commit
        # point nothing is visible, and a loser of a concurrent PUT leaves no trace.
        for link in links.values():
            self.files.write_link(record, link)
        try:
            self.files.create_record(record)
        except FileExistsError:
            self.files.objects.delete_tree(record.prefix)
            existing = self.find(subscription_id)
            if existing is None:
                raise SubscriptionExists("subscription was replaced concurrently; retry") from None
            return False, self._confirm(existing, spec)
        with self._registry_lock:
            created = Subscription(record, links, 0)
            subscription = self._subscriptions.setdefault(subscription_id, created)
        self._publish(put_change(entry_of(record, named_links(links))))
        with subscription.lock:
            self._try_next_wake(subscription)  # data appended while we linked
        return True, subscription

    @staticmethod
    def _confirm(existing: Subscription, spec: Spec) -> Subscription:
        if existing.spec.digest() != spec.digest():
            raise SubscriptionExists(f"subscription {existing.id} exists with another config")
        return existing

    def _initial_links(self, spec: Spec) -> dict[str, Link]:
        """Explicit streams and existing pattern matches, acknowledged up to their tails now."""
        links = {path: Link(path, explicit=True) for path in spec.streams}
        if spec.pattern is not None:
            pattern = tuple(spec.pattern.split("/"))
            for path in self.store.paths():
                if path != spec.wake_stream and matches(pattern, tuple(path.split("/"))):
                    links.setdefault(path, Link(path)).glob = True
        if len(links) > MAX_LINKS:
            raise BadSubscriptionRequest(f"a subscription links at most {MAX_LINKS} streams")
        tails = self._heads(list(links))
        for link in links.values():
            link.acked = tails[link.path]
        return {path: link for path, link in links.items() if link.explicit or link.acked}

    def delete(self, subscription_id: str) -> None:
        subscription_id = parse_subscription_id(subscription_id)
        with self._registry_lock:  # no `find` may load it again while storage still has it
            subscription = self._subscriptions.get(subscription_id)
            record = (
                subscription.record if subscription else self.files.read_record(subscription_id)
            )
            if record is None:
                return
            if subscription is not None:
                self._retire(subscription)
            self.files.delete(record)
        self._publish(drop_change(record.id, record.incarnation))

    def describe(self, subscription: Subscription) -> dict[str, object]:
        spec = subscription.spec
        body: dict[str, object] = {"id": subscription.id, "subscription_id": subscription.id,
                                   "type": spec.type}  # fmt: skip
        if spec.pattern is not None:
            body["pattern"] = spec.pattern
        links = sorted(subscription.links.values(), key=lambda link: link.path)
        body["streams"] = [link.describe() for link in links]
        if spec.webhook_url is not None:
            jwks_url = f"{subscription.record.root_url}/{RESERVED_PREFIX}/jwks.json"
            signing = {"alg": "ed25519", "kid": self.signer.kid, "jwks_url": jwks_url}
            body["webhook"] = {"url": spec.webhook_url, "signing": signing}
        if spec.wake_stream is not None:
            body["wake_stream"] = spec.wake_stream
        body.update(
            lease_ttl_ms=spec.lease_ttl_ms,
            created_at=subscription.record.created_at,
            status=subscription.status,
            generation=subscription.generation,
        )
        if spec.description is not None:
            body["description"] = spec.description
        return body

    # -- explicit links --

    def add_streams(self, subscription_id: str, paths: tuple[str, ...]) -> None:
        subscription = self.require(subscription_id)
        with subscription.lock:
            new = [path for path in paths if path not in subscription.links]
            if len(subscription.links) + len(new) > MAX_LINKS:
                raise BadSubscriptionRequest(f"a subscription links at most {MAX_LINKS} streams")
            if subscription.spec.wake_stream in paths:
                raise BadSubscriptionRequest("a subscription cannot link its own wake stream")
            tails = self._heads(new)
            named = []
            for path in paths:
                link = subscription.links.get(path) or Link(path, acked=tails[path])
                if not link.explicit:
                    named.append(path)
                link.explicit = True
                self.files.write_link(subscription.record, link)
                subscription.links[path] = link
        if named:
            record = subscription.record
            self._publish(name_change(record.id, record.incarnation, named, []))

    def remove_stream(self, subscription_id: str, path: str) -> None:
        subscription = self.require(subscription_id)
        with subscription.lock:
            link = subscription.links.get(path)
            if link is None or not link.explicit:
                return
            if link.glob or subscription.matches(path):  # the pattern keeps it, acks and all
                link.glob = True
                self.files.write_link(subscription.record, link)
                self.files.remove_explicit(subscription.record, path)
                link.explicit = False
            else:
                self.files.remove_link(subscription.record, path)
                del subscription.links[path]
        record = subscription.record
        self._publish(name_change(record.id, record.incarnation, [], [path]))

    # -- streams that grew here: tell the subscriptions that link them --

    def on_stream_changed(self, info: StreamInfo) -> None:
        """Store listener, after each commit in this process: tell every subscription that
        links the stream its tail, at the subscription's member. It runs in the writer's
        greenlet, so it waits for nothing; for a stream no subscription links, it only
        looks in the directory (and reads that again when due)."""
        if self.directory.due_after_commit():
            gevent.spawn(self._read_directory_and_tell, info)
            return
        if not self.directory.entries:  # no subscription at all: nothing to tell
            return
        for subscription_id in self.directory.linking(info.path):
            self._tell(subscription_id, info.path, Ack(info.incarnation, info.tail))

    def _read_directory_and_tell(self, info: StreamInfo) -> None:
        try:
            self.directory.read()
        except StorageUnavailable as error:
            log.warning("subscription directory not read (told from what it holds): %s", error)
        for subscription_id in self.directory.linking(info.path):
            self._tell(subscription_id, info.path, Ack(info.incarnation, info.tail))

    def _tell_held(self, entries: list[Entry]) -> None:
        """Directory.on_learn: streams held here that a subscription learned of late links
        may have grown while this member did not know: tell it their tails."""
        if not entries:
            return
        for info in self.store.held():
            for entry in entries:
                if entry.links(info.path):
                    self._tell(entry.id, info.path, Ack(info.incarnation, info.tail))

    def _tell(self, subscription_id: str, path: str, tail: Ack) -> None:
        self._news.setdefault(subscription_id, {})[path] = tail
        if subscription_id not in self._telling:
            self._telling.add(subscription_id)
            gevent.spawn(self._send_news, subscription_id)

    def _send_news(self, subscription_id: str) -> None:
        """Tell the subscription's member the tails gathered for it, until none are left:
        one message at a time per subscription, each with all that gathered meanwhile. A
        member that cannot be reached is asked again, backing off up to a minute."""
        attempt = 0
        try:
            while self._news.get(subscription_id):
                tails = self._news.pop(subscription_id)
                try:
                    if self._ask(subscription_id, "news", news_body(subscription_id, tails)):
                        self.news(subscription_id, tails)
                    attempt = 0
                except StorageUnavailable as error:
                    log.warning("subscription %s not told of %d streams yet: %s",
                                subscription_id, len(tails), error)  # fmt: skip
                    waiting = self._news.setdefault(subscription_id, {})
                    for path, tail in tails.items():
                        waiting.setdefault(path, tail)  # a newer tail told meanwhile wins
                    gevent.sleep(retry_delay(attempt))
                    attempt += 1
        finally:
            self._telling.discard(subscription_id)

    def _ask(self, subscription_id: str, name: str, body: dict) -> bool:
        """Ask the subscription's member; True when that is this process (serve it here)."""
        return self.peers.ask(subscription_key(subscription_id), name, body) is None

    def news(self, subscription_id: str, tails: dict[str, Ack]) -> None:
        """Tails of streams a subscription links, from the streams' members: link those its
        pattern matches anew, and wake it if one has data pending. Raises
        StorageUnavailable (the news is told again)."""
        subscription = self.find(subscription_id)
        if subscription is None:
            return  # deleted: the directory that named it was stale
        with subscription.lock:
            for path, tail in tails.items():
                if subscription.retired:
                    return
                try:
                    self._link_and_wake(subscription, path, tail)
                except (TakenOver, StoreError) as error:
                    log.info("subscription %s: %s", subscription.id, error)

    def _link_and_wake(self, subscription: Subscription, path: str, tail: Ack) -> None:
        link = subscription.links.get(path)
        if link is None:
            if not subscription.matches(path):
                return  # told from a stale directory
            if len(subscription.links) >= MAX_LINKS:
                log.warning("subscription %s is at %d links", subscription.id, MAX_LINKS)
                return
            link = Link(path, glob=True)  # created after the subscription: all pending
            self.files.write_link(subscription.record, link)
            subscription.links[path] = link
        if subscription.wake is None and LinkState(link, tail).pending:
            self._start_wake(subscription, self._states(subscription), path)

    # -- tails of streams, from their members --

    def _heads(self, paths: list[str]) -> dict[str, Ack | None]:
        """The tail of each stream (None: gone, or not served), from its member: those this
        member serves from its handles, the others in one message per member (per
        HEADS_PER_MESSAGE streams). Raises StorageUnavailable."""
        tails: dict[str, Ack | None] = {}
        elsewhere: dict[Owner, list[str]] = defaultdict(list)
        for path in paths:
            owner = self.membership.known_owner(path)
            if owner is None:
                tails[path] = self._own_head(path)
            else:
                elsewhere[owner].append(path)
        for owner, asked in elsewhere.items():
            for start in range(0, len(asked), HEADS_PER_MESSAGE):
                batch = asked[start : start + HEADS_PER_MESSAGE]
                answer = self.peers.post(owner, "heads", {"paths": batch})
                found = decode_tails(answer["tails"]) if answer is not None else {}
                tails.update(found)
                for path in batch:
                    if path not in found:  # its member moved: ask where it is now
                        self.membership.forget_owner(path)
                        tails[path] = self._head_anywhere(path)
        return tails

    def _head_anywhere(self, path: str) -> Ack | None:
        answer = self.peers.ask(path, "heads", {"paths": [path]})
        if answer is None:
            return self._own_head(path)
        found = decode_tails(answer["tails"])
        if path not in found:
            raise PeerUnavailable(f"the server of {path} keeps moving; retry")
        return found[path]

    def _own_head(self, path: str) -> Ack | None:
        try:
            info = self.store.head(path)
        except (StreamNotFound, StreamGone):
            return None
        except StoreError as error:  # e.g. a fork chain too deep to load: as if gone
            log.warning("subscription link %s is not served: %s", path, error)
            return None
        return Ack(info.incarnation, info.tail)

    def _states(self, subscription: Subscription) -> list[LinkState]:
        links = sorted(subscription.links.values(), key=lambda link: link.path)
        tails = self._heads([link.path for link in links])
        return [LinkState(link, tails[link.path]) for link in links]

    # -- what other members ask here (peers.py) --

    def answer_heads(self, body: dict) -> dict:
        """The tails of the streams asked that this member serves; the others it leaves
        out, and the asker looks for their members."""
        tails = {}
        for path in body["paths"]:
            if self.membership.owner_for(path) is None:
                tails[path] = self._own_head(path)
        return {"tails": encode_tails(tails)}

    def answer_news(self, body: dict) -> dict | None:
        subscription_id = body["subscription"]
        if self.membership.owner_for(subscription_key(subscription_id)) is not None:
            return None
        self.news(subscription_id, decode_tails(body["tails"]))  # type: ignore[arg-type]
        return {}

    def answer_wake_event(self, body: dict) -> dict | None:
        stream = body["stream"]
        if self.membership.owner_for(stream) is not None:
            return None
        try:
            self.append_wake_event(stream, body["event"])
        except StoreError as error:
            return {"error": str(error)}
        return {}

    def answer_directory(self, body: dict) -> dict:
        self.directory.apply(body)
        return {}

    # -- wakes --

    def _wake_if_pending(self, subscription: Subscription) -> bool:
        """Start the next wake if any linked stream has unacknowledged data."""
        if subscription.retired or subscription.wake is not None:
            return False
        states = self._states(subscription)
        pending = [state for state in states if state.pending]
        if not pending:
            return False
        self._start_wake(subscription, states, pending[0].link.path)
        return True

    def _start_wake(self, subscription: Subscription, states: list[LinkState], path: str) -> None:
        """Raises TakenOver, having retired the subscription, if another server took it."""
        wake_id = "w_" + secrets.token_hex(12)
        try:
            generation = self.files.start_generation(
                subscription.record, subscription.generation, wake_id
            )
        except TakenOver:
            self._retire(subscription)
            raise
        subscription.generation = generation
        wake = Wake(wake_id, generation, states)
        if subscription.spec.type == "webhook":
            wake.token = self.tokens.issue(subscription, wake)
            subscription.wake = wake
            gevent.spawn(self._deliver, subscription, wake)
        else:
            subscription.wake = wake
            self._append_wake_event(subscription, wake, path)

    def _try_next_wake(self, subscription: Subscription) -> bool:
        """Start the next wake if work is pending; a storage failure only postpones it."""
        try:
            return self._wake_if_pending(subscription)
        except (StorageUnavailable, StoreError, TakenOver) as error:
            log.warning("subscription %s: next wake postponed: %s", subscription.id, error)
            return False

    def _finish(self, subscription: Subscription) -> None:
        """End the current wake at its commit point (`end_generation`). Raises TakenOver,
        having retired the subscription, when another server took it over; raises
        StorageUnavailable, the wake still current, when storage cannot say."""
        wake = subscription.wake
        if wake is None:
            return
        try:
            self.files.end_generation(subscription.record, wake.generation, wake.id)
        except TakenOver:
            self._retire(subscription)
            raise
        self._end_wake(subscription)

    def _end_here(self, subscription: Subscription) -> bool:
        """End the current wake, which nothing completes (its lease ran out, or its
        deliveries): recorded if storage allows, ended here in any case. False when
        another server took the subscription over."""
        try:
            self._finish(subscription)
        except TakenOver:
            return False
        except StorageUnavailable as error:
            log.warning("subscription %s: end of a wake not recorded: %s", subscription.id, error)
            self._end_wake(subscription)
        return True

    def _end_wake(self, subscription: Subscription) -> None:
        wake, subscription.wake = subscription.wake, None
        if wake is not None and wake.lease is not None and wake.lease is not gevent.getcurrent():
            wake.lease.kill(block=False)

    def _extend_lease(self, subscription: Subscription, wake: Wake) -> None:
        seconds = subscription.spec.lease_ttl_ms / 1000
        if wake.lease is not None:
            wake.lease.kill(block=False)
        wake.lease_expires = time.monotonic() + seconds
        wake.lease = gevent.spawn_later(seconds, self._lease_expired, subscription, wake)

    def _lease_expired(self, subscription: Subscription, wake: Wake) -> None:
        with subscription.lock:
            if subscription.wake is not wake or not self._still_serves(subscription):
                return
            log.info("subscription %s: lease of wake %s expired", subscription.id, wake.id)
            if self._end_here(subscription):
                self._try_next_wake(subscription)

    def _append_wake_event(self, subscription: Subscription, wake: Wake, path: str) -> None:
        event = {"type": "wake", "subscription_id": subscription.id, "stream": path,
                 "generation": wake.generation, "ts": int(time.time() * 1000)}  # fmt: skip
        wake_stream = subscription.spec.wake_stream or ""
        try:
            answer = self.peers.ask(wake_stream, "wake-event", {"stream": wake_stream,
                                                                "event": event})  # fmt: skip
            if answer is None:
                self.append_wake_event(wake_stream, event)
            elif "error" in answer:
                raise StreamConflict(answer["error"])
        except (StoreError, StorageUnavailable) as error:
            log.warning("subscription %s: no wake event on %s: %s", subscription.id,
                        wake_stream, error)  # fmt: skip

    def append_wake_event(self, wake_stream: str, event: dict) -> None:
        """Append `event` to a wake stream this member serves, in the stream's content
        type. Raises StoreError (e.g. the wake stream was deleted)."""
        info = self.store.head(wake_stream)
        data = orjson.dumps(event)
        is_json = is_json_type(info.content_type)
        payload = Payload.from_messages([data]) if is_json else Payload(data + b"\n")
        self.store.append(wake_stream, AppendRequest(info.content_type, payload))

    # -- webhook delivery --

    def _deliver(self, subscription: Subscription, wake: Wake) -> None:
        """POST the wake until the receiver answers 2xx, backing off; then give it up.
        Before each attempt, this member makes sure it still serves the subscription."""
        body = orjson.dumps({
            "subscription_id": subscription.id, "wake_id": wake.id, "generation": wake.generation,
            "streams": [state.describe() for state in wake.states],
            "callback_url": self._action_url(subscription, "callback"),
            "callback_token": wake.token,
        })  # fmt: skip
        for attempt in range(MAX_DELIVERY_ATTEMPTS):
            if subscription.wake is not wake or not self._still_serves(subscription):
                return
            reply = self._post(subscription, body)
            if reply is not None:
                self._delivered(subscription, wake, reply)
                return
            subscription.status = "failed"
            gevent.sleep(retry_delay(attempt))
        with subscription.lock:
            if subscription.wake is wake:
                log.warning("subscription %s: gave up on wake %s", subscription.id, wake.id)
                self._end_here(subscription)

    def _post(self, subscription: Subscription, body: bytes) -> dict | None:
        """The receiver's JSON reply to one POST (an empty dict if not JSON); None on failure.

        The URL is checked again, and its host resolved again, before every attempt. The
        whole attempt ends within `webhook_timeout`: the socket timeouts bound each read,
        and a receiver that trickles its reply would otherwise hold the wake.
        """
        headers = {"Content-Type": "application/json",
                   SIGNATURE_HEADER: self.signer.sign(body, int(time.time()))}  # fmt: skip
        try:
            with gevent.Timeout(self.webhook_timeout, WebhookTimedOut):
                url = subscription.spec.webhook_url or ""
                target = check_webhook_url(url, self.webhook_networks)
                status, reply = post_webhook(target, body, headers)
        except (
            WebhookUrlRejected, WebhookTimedOut, urllib3.exceptions.HTTPError, OSError
        ) as error:  # fmt: skip
            log.info("subscription %s: webhook failed: %s", subscription.id, error)
            return None
        if not 200 <= status < 300:
            log.info("subscription %s: webhook answered %d", subscription.id, status)
            return None
        try:
            value = orjson.loads(reply)
        except orjson.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    def _delivered(self, subscription: Subscription, wake: Wake, reply: dict) -> None:
        """A 2xx reply: `{"done": true}` ends the wake and acknowledges the tails it
        reported; any other reply leaves the consumer the lease to call back."""
        with subscription.lock:
            subscription.status = "active"
            if subscription.wake is not wake or not self._still_serves(subscription):
                return  # called back (or the lease ran out) before replying; or moved
            if reply.get("done") is not True:
                self._extend_lease(subscription, wake)
                return
            try:
                self._finish(subscription)
            except TakenOver:
                return
            except StorageUnavailable:
                log.exception("subscription %s: done not recorded; the lease will redeliver",
                              subscription.id)  # fmt: skip
                self._extend_lease(subscription, wake)
                return
            try:
                for state in wake.states:
                    if state.tail is not None and state.pending:
                        self._acknowledge(subscription, state.link.path, state.tail)
            except (StorageUnavailable, StoreError):
                log.exception("subscription %s: acks of a done reply not recorded; the next"
                              " wake brings the data again", subscription.id)  # fmt: skip
            self._try_next_wake(subscription)

    def _action_url(self, subscription: Subscription, action: str) -> str:
        root = subscription.record.root_url
        return f"{root}/{RESERVED_PREFIX}/subscriptions/{subscription.id}/{action}"

    # -- callback, claim, ack, release --

    def callback(self, subscription_id: str, token: str, ack: AckRequest) -> dict:
        return self._progress(self.require(subscription_id), token, ack, "webhook")

    def ack(self, subscription_id: str, token: str, ack: AckRequest) -> dict:
        return self._progress(self.require(subscription_id), token, ack, "pull-wake")

    def claim(self, subscription_id: str, worker: str) -> dict:
        subscription = self.require(subscription_id)
        self._require_type(subscription, "pull-wake")
        with subscription.lock:
            wake = subscription.wake
            if wake is not None and wake.leased:
                raise AlreadyClaimed(
                    "another worker holds this subscription's wake",
                    current_holder=wake.holder, generation=wake.generation,
                )  # fmt: skip
            try:
                if wake is not None and wake.holder is not None:
                    self._finish(subscription)  # its lease ran out; the timer has not fired yet
                if subscription.wake is None and not self._wake_if_pending(subscription):
                    raise NoPendingWork("no linked stream has unacknowledged data")
            except TakenOver as error:
                raise PeerUnavailable("this subscription moved to another server; retry") from error
            wake = subscription.wake
            assert wake is not None
            states = self._states(subscription)
            wake.holder, wake.token = worker, self.tokens.issue(subscription, wake)
            self._extend_lease(subscription, wake)
            return {"wake_id": wake.id, "generation": wake.generation, "token": wake.token,
                    "streams": [state.describe() for state in states],
                    "lease_ttl_ms": subscription.spec.lease_ttl_ms}  # fmt: skip

    def release(self, subscription_id: str, token: str, ack: AckRequest) -> None:
        subscription = self.require(subscription_id)
        self._require_type(subscription, "pull-wake")
        with subscription.lock:
            self._check_wake(subscription, token, ack)
            self._finish(subscription)
            self._try_next_wake(subscription)

    def _progress(self, subscription: Subscription, token: str, ack: AckRequest, kind: str) -> dict:
        """Acks, and with `done` the end of the wake: its commit point comes first
        (`_finish`), so a server that lost the subscription records no acks of it."""
        self._require_type(subscription, kind)
        with subscription.lock:
            wake = self._check_wake(subscription, token, ack)
            targets = [self._ack_target(subscription, path, offset) for path, offset in ack.acks]
            if not ack.done:
                for path, position in targets:
                    self._acknowledge(subscription, path, position)
                self._extend_lease(subscription, wake)
                return {"ok": True, "next_wake": False}
            self._finish(subscription)
            try:
                for path, position in targets:
                    self._acknowledge(subscription, path, position)
            finally:
                next_wake = self._try_next_wake(subscription)
            return {"ok": True, "next_wake": next_wake}

    @staticmethod
    def _require_type(subscription: Subscription, kind: str) -> None:
        if subscription.spec.type != kind:
            raise BadSubscriptionRequest(
                f"subscription {subscription.id} is not a {kind} subscription"
            )

    def _check_wake(self, subscription: Subscription, token: str, ack: AckRequest) -> Wake:
        """The current wake, if the token and the request both name it; else FENCED."""
        claims = self.tokens.verify(token, subscription)
        wake = subscription.wake
        if (
            wake is None
            or (claims["wake"], claims["gen"]) != (wake.id, wake.generation)
            or (ack.wake_id, ack.generation) != (wake.id, wake.generation)
        ):
            raise Fenced(
                "this wake is over; a newer one may have started",
                generation=subscription.generation,
            )
        return wake

    def _ack_target(self, subscription: Subscription, path: str, offset: str) -> tuple[str, Ack]:
        """Validate one ack against the link and the stream's tail (before anything is written)."""
        link = subscription.links.get(path)
        if link is None:
            raise InvalidOffset(f"{path} is not linked to this subscription")
        if offset == BEFORE_FIRST:
            raise InvalidOffset("an ack offset cannot be -1")
        try:
            position = parse_offset(offset)
        except BadRequest as error:
            raise BadSubscriptionRequest(str(error)) from error
        tail = self._heads([path])[path]
        if tail is None or position > tail.position:
            raise InvalidOffset(f"offset {offset} is beyond the tail of {path}")
        state = LinkState(link, tail)
        if state.acked is not None and position < state.acked.position:
            raise InvalidOffset(f"offset {offset} is before what {path} already acknowledged")
        return path, Ack(tail.incarnation, position)

    def _acknowledge(self, subscription: Subscription, path: str, ack: Ack) -> None:
        """Record an ack; within one stream incarnation acks only move forward."""
        link = subscription.links.get(path)
        if link is None:
            return
        previous = link.acked
        if previous is not None and previous.incarnation == ack.incarnation:
            if ack.position <= previous.position:
                return
        self.files.write_ack(subscription.record, path, ack, link.acked)
        link.acked = ack


def entry_of(record: Record, named: frozenset[str]) -> Entry:
    """The subscription's entry in the directory (directory.py)."""
    pattern = record.spec.pattern
    return Entry(record.id, record.incarnation, tuple(pattern.split("/")) if pattern else None,
                 record.spec.wake_stream, named)  # fmt: skip


def named_links(links: dict[str, Link]) -> frozenset[str]:
    return frozenset(path for path, link in links.items() if link.explicit)


def encode_tails(tails: dict[str, Ack | None]) -> dict[str, list | None]:
    """Tails for a peer message: [incarnation, position], or null for no stream."""
    return {
        path: [tail.incarnation, tail.position] if tail else None for path, tail in tails.items()
    }


def decode_tails(encoded: dict[str, list | None]) -> dict[str, Ack | None]:
    return {path: Ack(*tail) if tail else None for path, tail in encoded.items()}


def news_body(subscription_id: str, tails: dict[str, Ack]) -> dict:
    return {"subscription": subscription_id, "tails": encode_tails(dict(tails))}


def _new_signing_key() -> bytes:
    private = Ed25519PrivateKey.generate()
    signer = WebhookSigner(private)
    raw = private.private_bytes_raw()
    return orjson.dumps({"kid": signer.kid, "d": encode_base64url(raw)})


# -- HTTP ------------------------------------------------------------------------------


def stream_root() -> str:
    return request.url_root.rstrip("/") + STREAM_PREFIX.rstrip("/")


def require_link_grants(spec: Spec) -> None:
    """AuthError 403 unless the caller may read all `spec` links and append to its wake stream.

    Checked once, at PUT, against the creating token: then the server links, lists and
    announces only streams its creator could read, and writes wake events only where
    it could append. A pattern must lie within one read grant (`auth.includes`).
    """
    if spec.pattern is not None and not request_covers("read", spec.pattern):
        raise AuthError(403, "insufficient_scope", "no read grant of the token covers the pattern")
    require_read(spec.streams)
    if spec.wake_stream is not None and not request_allows("append", spec.wake_stream):
        raise AuthError(403, "insufficient_scope", "the token does not grant append on wake_stream")


def require_read(paths: tuple[str, ...]) -> None:
    if not all(request_allows("read", path) for path in paths):
        raise AuthError(403, "insufficient_scope", "the token does not grant read on every stream")


def readable_only(body: dict) -> dict:
    """A subscription or claim answer, listing only the linked streams the caller may read."""
    body["streams"] = [
        stream for stream in body["streams"] if request_allows("read", stream["path"])
    ]
    return body


class SubscriptionViews:
    """One method per route; each parses, makes one call on `Subscriptions`, answers."""

    def __init__(self, subscriptions: Subscriptions) -> None:
        self.subscriptions = subscriptions

    def answer(self, view: Callable[..., Response], methods: tuple[str, ...]) -> Callable:
        """Wrap a view: preflight, 405, and outcomes to JSON errors (never a 500 for input)."""

        def handle(**arguments: str) -> Response:
            if request.method == "OPTIONS":
                headers = {"Access-Control-Allow-Headers": "Content-Type, Authorization",
                           "Access-Control-Max-Age": "86400"}  # fmt: skip
                return Response(status=204, headers=headers)
            try:
                if request.method not in methods:
                    raise MethodNotAllowed(f"use {', '.join(methods)}")
                return view(**arguments)
            except SubscriptionError as error:
                return error_response(error.status, error.code, str(error), details=error.details)
            except WebhookUrlRejected as error:  # from webhooks.py, at PUT
                return error_response(400, "WEBHOOK_URL_REJECTED", str(error))
            except AuthError as error:
                log.info("refused %s %s: %s", request.method, request.path, error)
                return refusal(error)
            except StorageUnavailable as error:
                log.warning("storage unavailable: %s", error)
                retry = {"Retry-After": RETRY_AFTER_SECONDS}
                return error_response(503, "STORAGE_UNAVAILABLE", "retry", retry)

        handle.__name__ = view.__name__
        return handle

    def jwks(self) -> Response:
        response = json_response(self.subscriptions.jwks(), headers={"Content-Type": JWK_SET_TYPE})
        response.headers["Cache-Control"] = "public, max-age=300"
        return response

    def subscription(self, sub_id: str) -> Response:
        if request.method == "PUT":
            spec = parse_spec(parse_json_object(request.get_data()))
            require_link_grants(spec)
            created, subscription = self.subscriptions.create(
                parse_subscription_id(sub_id), spec, stream_root()
            )
            body = readable_only(self.subscriptions.describe(subscription))
            return json_response(body, 201 if created else 200)
        if request.method == "DELETE":
            self.subscriptions.delete(sub_id)
            return Response(status=204)
        subscription = self.subscriptions.require(sub_id)
        return json_response(readable_only(self.subscriptions.describe(subscription)))

    def streams(self, sub_id: str) -> Response:
        body = parse_json_object(request.get_data())
        paths = parse_paths(body.get("streams"), "streams")
        if not paths:
            raise BadSubscriptionRequest("streams must be a non-empty list of paths")
        require_read(paths)
        self.subscriptions.add_streams(sub_id, paths)
        return Response(status=204)

    def stream(self, sub_id: str, stream_path: str) -> Response:
        self.subscriptions.remove_stream(sub_id, parse_path(stream_path, "stream"))
        return Response(status=204)

    def action(self, sub_id: str, action: str) -> Response:
        body = parse_json_object(request.get_data())
        if action == "claim":
            return json_response(
                readable_only(self.subscriptions.claim(sub_id, parse_worker(body)))
            )
        self.subscriptions.require(sub_id)  # 404 before 401
        token = wake_token()
        if action == "release":
            self.subscriptions.release(sub_id, token, parse_ack_request(body))
            return Response(status=204)
        progress = self.subscriptions.callback if action == "callback" else self.subscriptions.ack
        return json_response(progress(sub_id, token, parse_ack_request(body)))


def register_subscriptions(
    app: Flask, store: StreamStore, settings: Settings, membership: Membership, peers: Peers
) -> Subscriptions:
    """Route `{root}/__ds/...` to the subscription views, and what other members ask
    (peers.py) to the subscriptions; listen to the store and to the membership.

    The rules are more specific than the stream route's `<path:path>`, so Werkzeug
    tries them first; each takes every method and answers 405 itself, so no `__ds`
    request falls through to stream handling.
    """
    subscriptions = Subscriptions(
        store, membership, peers, settings.webhook_allowed_networks, settings.webhook_timeout
    )
    views = SubscriptionViews(subscriptions)
    routes = [
        ("/jwks.json", views.jwks, ("GET", "HEAD")),
        ("/subscriptions/<sub_id>", views.subscription, ("PUT", "GET", "HEAD", "DELETE")),
        ("/subscriptions/<sub_id>/streams", views.streams, ("POST",)),
        ("/subscriptions/<sub_id>/streams/<path:stream_path>", views.stream, ("DELETE",)),
        ("/subscriptions/<sub_id>/<any(callback, claim, ack, release):action>", views.action,
         ("POST",)),
    ]  # fmt: skip
    for rule, view, methods in routes:
        endpoint = f"subscriptions.{view.__name__}"
        handler = views.answer(view, methods)
        app.add_url_rule(ROUTE_ROOT + rule, endpoint, handler, methods=ALL_METHODS)
    peers.route(app, "heads", subscriptions.answer_heads)
    peers.route(app, "news", subscriptions.answer_news)
    peers.route(app, "wake-event", subscriptions.answer_wake_event)
    peers.route(app, "directory", subscriptions.answer_directory)
    store.listeners.append(subscriptions.on_stream_changed)
    membership.on_change.append(subscriptions.partition_changed)
    membership.on_start.append(subscriptions.resume)
    app.extensions["picomq.subscriptions"] = subscriptions
    return subscriptions
