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
    subscriptions/<id>/<incarnation>/generations/<n>              last wake generation

An acknowledged offset names the stream incarnation it belongs to, so a stream deleted
and created again is read from its start. The private key never leaves storage and this
process; `…/jwks.json` serves only the public half.

With several workers (gunicorn processes), what holds: configs, links and acknowledged
offsets are durable and shared; PUT is idempotent across workers (the create-only
config decides); signing and token keys are shared, so signatures verify and tokens are
accepted in any worker; generation numbers are unique across workers and restarts (a
create-only marker per generation). What does not: the live wake (its id, holder,
lease and retries) lives only in the process that started it, so a callback, ack or
claim served by another worker is FENCED or starts a second wake there; store listeners
run only in the worker that served an append, so each worker wakes on its own appends; a
worker learns of subscriptions created or deleted elsewhere within REFRESH_SECONDS, but
of links and acks changed elsewhere only when it loads the subscription again (restart
or re-creation), so its GET may list a link another worker removed. A restart forgets
wakes in flight; each worker, once started, starts a new wake for every subscription
with pending data (with N workers, N wakes). For exact semantics run one worker, the
default; routing `__ds` by id to one worker is not enough, as appends wake everywhere.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import gevent
import orjson
import urllib3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from flask import Flask, request
from gevent.lock import RLock

from auth import AuthError, bearer_credentials, matches, refusal, request_allows, request_covers
from objectstore import ObjectStore, StorageUnavailable
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
)
from protocol import parse_stream_path as parse_picomq_path
from settings import Network, Settings
from storage import StreamStore
from streams import (
    AppendRequest,
    Payload,
    StoreError,
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
REFRESH_SECONDS = 2.0  # how stale this worker's list of subscriptions may get

MAX_BODY_BYTES = 1024 * 1024
MAX_STREAMS_PER_REQUEST = 1000
MAX_LINKS = 10_000
MAX_ACKS = 1000
MAX_DESCRIPTION_CHARS = 1024
MAX_WORKER_CHARS = 256
MAX_GENERATION_ATTEMPTS = 10
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
    identity: object  # of config.json; another value on storage means it was replaced
    links: dict[str, Link]
    generation: int
    wake: Wake | None = None
    status: str = "active"
    deleted: bool = False
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

    def identity(self, subscription_id: str) -> object | None:
        return self.objects.identity(self.config_key(subscription_id))

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

    def load_or_create(self, key: str, make: Callable[[], bytes]) -> bytes:
        """Read an object that is made once: the first writer wins, everyone reads its bytes."""
        try:
            return self.objects.read(key)
        except FileNotFoundError:
            pass
        data = make()
        try:
            self.objects.create(key, data)
        except FileExistsError:
            return self.objects.read(key)
        return data

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

    # -- generations --

    def read_generation(self, record: Record) -> int:
        names = self.objects.list(f"{record.prefix}/generations")
        return max((int(name) for name in names if name.isdigit()), default=0)

    def start_generation(self, record: Record, previous: int) -> int:
        """Claim the next generation number; unique across workers because create-only."""
        generation = previous + 1
        for _ in range(MAX_GENERATION_ATTEMPTS):
            try:
                self.objects.create(f"{record.prefix}/generations/{generation:020d}", b"")
            except FileExistsError:
                generation = max(generation, self.read_generation(record)) + 1
                continue
            if previous:
                self._delete_once(f"{record.prefix}/generations/{previous:020d}")
            return generation
        raise StorageUnavailable("too many workers starting wakes at once; retry")

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


# -- the subscriptions of one process ----------------------------------------------------


class Subscriptions:
    """Create, read, delete and link subscriptions; wake consumers; take their acks.

    State changes of one subscription happen under its lock; the lock is never held
    across a webhook POST (deliveries run in their own greenlet).
    """

    def __init__(
        self, store: StreamStore, webhook_networks: tuple[Network, ...], webhook_timeout: float
    ) -> None:
        self.store = store
        self.webhook_networks = webhook_networks  # reachable besides public addresses
        self.webhook_timeout = webhook_timeout  # seconds for one delivery attempt, in all
        self.files = SubscriptionObjects(store.objects)
        self._subscriptions: dict[str, Subscription] = {}
        self._registry_lock = RLock()
        self._refreshed_at = float("-inf")
        self._signer: WebhookSigner | None = None
        self._tokens: WakeTokens | None = None

    # -- keys --

    @property
    def signer(self) -> WebhookSigner:
        if self._signer is None:
            data = self.files.load_or_create(SIGNING_KEY_OBJECT, _new_signing_key)
            key = Ed25519PrivateKey.from_private_bytes(decode_base64url(orjson.loads(data)["d"]))
            self._signer = WebhookSigner(key)
        return self._signer

    @property
    def tokens(self) -> WakeTokens:
        if self._tokens is None:
            self._tokens = WakeTokens(
                self.files.load_or_create(TOKEN_KEY_OBJECT, lambda: secrets.token_bytes(32))
            )
        return self._tokens

    def jwks(self) -> dict:
        return {"keys": [self.signer.jwk()]}

    # -- the registry: storage is the truth, this is a cache of it --

    def find(self, subscription_id: str) -> Subscription | None:
        """The subscription as storage has it now (re-loaded if replaced elsewhere)."""
        identity = self.files.identity(subscription_id)
        with self._registry_lock:
            current = self._subscriptions.get(subscription_id)
            if identity is None:
                if current is not None:
                    self._forget(current)
                return None
            if current is not None and current.identity == identity:
                return current
            record = self.files.read_record(subscription_id)
            if record is None:
                return None
            loaded = Subscription(
                record, identity, self.files.read_links(record), self.files.read_generation(record)
            )
            if current is not None:
                self._forget(current)
            self._subscriptions[subscription_id] = loaded
            return loaded

    def require(self, subscription_id: str) -> Subscription:
        subscription = self.find(parse_subscription_id(subscription_id))
        if subscription is None:
            raise SubscriptionNotFound(f"subscription {subscription_id} not found")
        return subscription

    def _refresh_due(self) -> bool:
        return time.monotonic() - self._refreshed_at >= REFRESH_SECONDS

    def refresh(self, force: bool = False) -> None:
        """Pick up subscriptions other workers created or deleted (at most every few seconds)."""
        if not force and not self._refresh_due():
            return
        self._refreshed_at = time.monotonic()
        ids = set(self.files.ids())
        for subscription_id in list(self._subscriptions):
            if subscription_id not in ids:
                self._forget(self._subscriptions[subscription_id])
        for subscription_id in ids:
            self.find(subscription_id)

    def resume(self) -> None:
        """After a start: load every subscription and wake those with data still pending."""
        try:
            self.refresh(force=True)
        except Exception:
            log.exception("subscriptions could not resume pending wakes")
            return
        for subscription in list(self._subscriptions.values()):
            try:  # one subscription that fails never keeps the others asleep
                with subscription.lock:
                    self._wake_if_pending(subscription)
            except Exception:
                log.exception("subscription %s could not resume its wake", subscription.id)

    def _forget(self, subscription: Subscription) -> None:
        with subscription.lock:
            subscription.deleted = True
            self._end_wake(subscription)
        if self._subscriptions.get(subscription.id) is subscription:
            del self._subscriptions[subscription.id]

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
        subscription = self.find(subscription_id)
        if subscription is None or subscription.record.incarnation != record.incarnation:
            raise SubscriptionExists("subscription was replaced concurrently; retry")
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
        for link in links.values():
            info = self._head(link.path)
            link.acked = Ack(info.incarnation, info.tail) if info else None
        return {path: link for path, link in links.items() if link.explicit or link.acked}

    def delete(self, subscription_id: str) -> None:
        subscription = self.find(parse_subscription_id(subscription_id))
        if subscription is None:
            return
        with self._registry_lock:  # no `find` may load it again while storage still has it
            self._forget(subscription)
            self.files.delete(subscription.record)

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
            for path in paths:
                link = subscription.links.get(path)
                if link is None:
                    info = self._head(path)
                    link = Link(path, acked=Ack(info.incarnation, info.tail) if info else None)
                link.explicit = True
                self.files.write_link(subscription.record, link)
                subscription.links[path] = link

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

    # -- stream changes (store listener) --

    def on_stream_changed(self, info: StreamInfo) -> None:
        """Store listener: runs in the writer's greenlet, so hand the work to another.

        Every commit calls it. With no subscription known and no refresh due there is
        nothing to hand over, and a greenlet would be spent on every commit for nothing.
        """
        if self._subscriptions or self._refresh_due():
            gevent.spawn(self._handle_change, info)

    def _handle_change(self, info: StreamInfo) -> None:
        try:
            self.refresh()
            for subscription in list(self._subscriptions.values()):
                linked = info.path in subscription.links
                if linked or subscription.matches(info.path):
                    with subscription.lock:
                        if not subscription.deleted:
                            self._link_and_wake(subscription, info)
        except Exception:
            log.exception("subscriptions could not handle a change of %s", info.path)

    def _link_and_wake(self, subscription: Subscription, info: StreamInfo) -> None:
        link = subscription.links.get(info.path)
        if link is None:
            if len(subscription.links) >= MAX_LINKS:
                log.warning("subscription %s is at %d links", subscription.id, MAX_LINKS)
                return
            link = Link(info.path, glob=True)  # created after the subscription: all pending
            self.files.write_link(subscription.record, link)
            subscription.links[info.path] = link
        if subscription.wake is None and LinkState(link, Ack(info.incarnation, info.tail)).pending:
            self._start_wake(subscription, self._states(subscription), info.path)

    # -- wakes --

    def _head(self, path: str) -> StreamInfo | None:
        """The linked stream's info; None when it is gone or cannot be served."""
        try:
            return self.store.head(path)
        except (StreamNotFound, StreamGone):
            return None
        except StoreError as error:  # e.g. a fork chain too deep to load: as if gone
            log.warning("subscription link %s is not served: %s", path, error)
            return None

    def _states(self, subscription: Subscription) -> list[LinkState]:
        states = []
        for link in sorted(subscription.links.values(), key=lambda link: link.path):
            info = self._head(link.path)
            states.append(LinkState(link, Ack(info.incarnation, info.tail) if info else None))
        return states

    def _wake_if_pending(self, subscription: Subscription) -> bool:
        """Start the next wake if any linked stream has unacknowledged data."""
        if subscription.deleted or subscription.wake is not None:
            return False
        states = self._states(subscription)
        pending = [state for state in states if state.pending]
        if not pending:
            return False
        self._start_wake(subscription, states, pending[0].link.path)
        return True

    def _start_wake(self, subscription: Subscription, states: list[LinkState], path: str) -> None:
        generation = self.files.start_generation(subscription.record, subscription.generation)
        subscription.generation = generation
        wake = Wake("w_" + secrets.token_hex(12), generation, states)
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
        except (StorageUnavailable, StoreError):
            log.exception("subscription %s: next wake postponed", subscription.id)
            return False

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
            if subscription.wake is not wake:
                return
            log.info("subscription %s: lease of wake %s expired", subscription.id, wake.id)
            self._end_wake(subscription)
            self._try_next_wake(subscription)

    def _append_wake_event(self, subscription: Subscription, wake: Wake, path: str) -> None:
        event = {"type": "wake", "subscription_id": subscription.id, "stream": path,
                 "generation": wake.generation, "ts": int(time.time() * 1000)}  # fmt: skip
        wake_stream = subscription.spec.wake_stream or ""
        data = orjson.dumps(event)
        try:
            info = self.store.head(wake_stream)
            is_json = is_json_type(info.content_type)
            payload = Payload.from_messages([data]) if is_json else Payload(data + b"\n")
            self.store.append(wake_stream, AppendRequest(info.content_type, payload))
        except (StoreError, StorageUnavailable) as error:
            log.warning("subscription %s: no wake event on %s: %s", subscription.id,
                        wake_stream, error)  # fmt: skip

    # -- webhook delivery --

    def _deliver(self, subscription: Subscription, wake: Wake) -> None:
        """POST the wake until the receiver answers 2xx, backing off; then give it up."""
        body = orjson.dumps({
            "subscription_id": subscription.id, "wake_id": wake.id, "generation": wake.generation,
            "streams": [state.describe() for state in wake.states],
            "callback_url": self._action_url(subscription, "callback"),
            "callback_token": wake.token,
        })  # fmt: skip
        for attempt in range(MAX_DELIVERY_ATTEMPTS):
            if subscription.deleted or subscription.wake is not wake:
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
                self._end_wake(subscription)

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
        with subscription.lock:
            subscription.status = "active"
            if subscription.wake is not wake:
                return  # the consumer called back (or the lease ran out) before replying
            if reply.get("done") is True:
                try:
                    for state in wake.states:
                        if state.tail is not None and state.pending:
                            self._acknowledge(subscription, state.link.path, state.tail)
                except (StorageUnavailable, StoreError):
                    log.exception("subscription %s: done not recorded; the lease will redeliver",
                                  subscription.id)  # fmt: skip
                else:
                    self._end_wake(subscription)
                    self._try_next_wake(subscription)
                    return
            self._extend_lease(subscription, wake)

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
            if wake is not None and wake.holder is not None:
                self._end_wake(subscription)  # its lease ran out; the timer has not fired yet
            if subscription.wake is None and not self._wake_if_pending(subscription):
                raise NoPendingWork("no linked stream has unacknowledged data")
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
            self._end_wake(subscription)
            self._try_next_wake(subscription)

    def _progress(self, subscription: Subscription, token: str, ack: AckRequest, kind: str) -> dict:
        self._require_type(subscription, kind)
        with subscription.lock:
            wake = self._check_wake(subscription, token, ack)
            targets = [self._ack_target(subscription, path, offset) for path, offset in ack.acks]
            for path, position in targets:
                self._acknowledge(subscription, path, position)
            if not ack.done:
                self._extend_lease(subscription, wake)
                return {"ok": True, "next_wake": False}
            self._end_wake(subscription)
            return {"ok": True, "next_wake": self._try_next_wake(subscription)}

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
        info = self._head(path)
        if info is None or position > info.tail:
            raise InvalidOffset(f"offset {offset} is beyond the tail of {path}")
        state = LinkState(link, Ack(info.incarnation, info.tail))
        if state.acked is not None and position < state.acked.position:
            raise InvalidOffset(f"offset {offset} is before what {path} already acknowledged")
        return path, Ack(info.incarnation, position)

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


def register_subscriptions(app: Flask, store: StreamStore, settings: Settings) -> Subscriptions:
    """Route `{root}/__ds/...` to the subscription views and listen to the store.

    The rules are more specific than the stream route's `<path:path>`, so Werkzeug
    tries them first; each takes every method and answers 405 itself, so no `__ds`
    request falls through to stream handling.
    """
    subscriptions = Subscriptions(
        store, settings.webhook_allowed_networks, settings.webhook_timeout
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
    store.listeners.append(subscriptions.on_stream_changed)
    gevent.spawn(subscriptions.resume)  # runs once this worker's event loop does
    app.extensions["picomq.subscriptions"] = subscriptions
    return subscriptions
