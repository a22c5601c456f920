"""Access control: who may create, append to, read and delete which stream.

Off unless a key is configured (`PICOMQ_JWT_SECRET` for HS256, or `PICOMQ_JWT_PUBLIC_KEY`
for EdDSA or RS256). Then every request carries a JWT, as `Authorization: Bearer <jwt>`
or, for browsers' EventSource, as the `access_token` query parameter, with an `exp`
and a `scope` claim: space-separated `action:pattern` grants, where a pattern is a
stream path in which `*` matches one segment (or, inside a segment, any characters of
it) and `**` any number of segments, none included.

What each request needs:

    PUT     create on the path, and read on the Stream-Forked-From source if given
    POST    append (closing a stream is an append)
    GET     read            HEAD   read            DELETE   delete
    OPTIONS nothing: CORS preflights never carry credentials
    __ds/…  admin on `__ds/…`, except jwks.json (the public key webhook receivers
            fetch) and the wake-token routes (callback, ack, release), which carry a
            token the server issued for one wake and subscriptions.py checks itself;
            subscriptions.py also asks `request_allows` and `request_covers` for read
            on every stream a subscription would link and append on its wake stream
    other   admin on the URL path without its leading slash (`admin:**` is everything),
            except /healthz, /readyz and the inspector page, which need no token

Missing or invalid credentials get 401 with `WWW-Authenticate`, and so does a revoked
token (revocations.py), also in the middle of a live read; a valid token without the
grant gets 403. The decision is made from the token and the request alone, before
any view runs and without asking the store, so a caller who may not read a path gets
the same answer whether a stream exists there or not. Signatures are checked by PyJWT
(HMAC compared in constant time); the token is taken out of the query string before
Flask, or any log line, sees the URL.

Keys rotate without downtime: a setting may name several keys by id, and a token's
`kid` header picks the one that verifies it (a token without one: the first listed).
A key removed from the set is retired, and with it every token it signed. With the
single-key form a token's kid is not looked at, as before keys had ids.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_plus

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key
from flask import Flask, Response, current_app, g, request

from objectstore import ObjectStore
from protocol import (
    FORKED_FROM,
    STREAM_PREFIX,
    BadRequest,
    error_response,
    is_reserved,
    parse_fork_source,
    words_of,
)
from revocations import Revocations
from settings import NamedKey, Settings, read_pem

log = logging.getLogger("picomq.auth")

ACTIONS = ("read", "append", "create", "delete", "admin")
ACTION_OF_METHOD = {
    "GET": "read",
    "HEAD": "read",
    "PUT": "create",
    "POST": "append",
    "DELETE": "delete",
}
TOKEN_PARAMETER = "access_token"
TOKEN_ENVIRON_KEY = "picomq.access_tokens"
ACCESS_CONTROL_KEY = "picomq.access_control"  # app.extensions: whether a key is configured
REVOCATIONS_KEY = "picomq.revocations"  # app.extensions: the Revocations, None when not checked
MAX_TOKEN_CHARS = 8192
LEEWAY_SECONDS = 30  # clock skew allowed on exp, nbf and iat
CHALLENGE = 'Bearer realm="picomq"'
WAKE_TOKEN_ACTIONS = frozenset({"callback", "ack", "release"})
# Public by nature: the webhook-verification key, probes that balancers send without
# credentials, and the inspector's static page (its requests carry their own token).
ANONYMOUS_ENDPOINTS = frozenset({"subscriptions.jwks", "healthz", "readyz", "inspector"})
DURATION = re.compile(r"(\d{1,9})([smhd]?)")
SECONDS_PER_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class AuthError(Exception):
    """A request refused before its view: `status` 400, 401 or 403, RFC 6750 `error`."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error


# -- scopes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """One `action:pattern` item of a token's scope."""

    action: str
    pattern: tuple[str, ...]

    def allows(self, action: str, path: str) -> bool:
        return action == self.action and matches(self.pattern, tuple(path.split("/")))

    def covers(self, action: str, pattern: str) -> bool:
        """Whether this grant allows `action` on every path the glob `pattern` matches."""
        return action == self.action and includes(self.pattern, tuple(pattern.split("/")))


def granted(grants: Iterable[Grant], action: str, path: str) -> bool:
    return any(grant.allows(action, path) for grant in grants)


def parse_scope(scope: str, *, strict: bool = False) -> tuple[Grant, ...]:
    """The grants in a space-separated scope.

    The server skips items it does not understand (they grant nothing, and a newer
    minter may know actions this server does not); `strict` (for the token command)
    raises ValueError on them instead, so an operator's typo is caught when minting.
    """
    grants = []
    for item in scope.split():
        action, _, pattern = item.partition(":")
        segments = tuple(pattern.strip("/").split("/"))
        problem = scope_item_problem(action, segments)
        if problem is None:
            grants.append(Grant(action, segments))
        elif strict:
            raise ValueError(f"scope item {item!r}: {problem}")
    return tuple(grants)


def scope_item_problem(action: str, segments: tuple[str, ...]) -> str | None:
    if action not in ACTIONS:
        return f"action must be one of {', '.join(ACTIONS)}"
    if any(segment in ("", ".", "..") for segment in segments):
        return "the pattern needs a path with no empty, '.' or '..' segments"
    if any("**" in segment and segment != "**" for segment in segments):
        return "'**' must be a whole segment"
    return None


def matches(pattern: tuple[str, ...], path: tuple[str, ...]) -> bool:
    """Whether a pattern's segments match a path's, in O(len(pattern) * len(path))."""
    return consumes(pattern, path, path_is_pattern=False)


def includes(pattern: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    """Whether `pattern` matches every path that the pattern `inner` matches.

    A sufficient test that never wrongly says yes: each segment of `inner` must be taken
    by a `**` of `pattern`, or by one segment whose `*`s can stand for its text, its own
    `*`s included (`run-*` takes `run-1*`); a `**` of `inner` only by a `**`. It says no
    to an `inner` that only several patterns cover together.
    """
    return consumes(pattern, inner, path_is_pattern=True)


def consumes(pattern: tuple[str, ...], path: tuple[str, ...], *, path_is_pattern: bool) -> bool:
    reachable = {0}  # how many path segments the pattern so far can have consumed
    for segment in pattern:
        if segment == "**":
            reachable = set(range(min(reachable), len(path) + 1))
        else:
            matcher = segment_matcher(segment)
            reachable = {
                i + 1
                for i in reachable
                if i < len(path) and not (path_is_pattern and path[i] == "**") and matcher(path[i])
            }
        if not reachable:
            return False
    return len(path) in reachable


@functools.lru_cache(maxsize=4096)
def segment_matcher(segment: str) -> Callable[[str], bool]:
    if "*" not in segment:
        return segment.__eq__
    pieces = (re.escape(piece) for piece in segment.split("*"))
    expression = re.compile("[^/]*".join(pieces))
    return lambda text: expression.fullmatch(text) is not None


# -- tokens -------------------------------------------------------------------------


@dataclass(frozen=True)
class VerificationKey:
    """A key and the one algorithm it verifies: a token's own `alg` is never trusted."""

    key: object
    algorithm: str

    @staticmethod
    def from_setting(named: NamedKey, is_secret: bool) -> VerificationKey:
        if is_secret:
            return VerificationKey(named.text.encode(), "HS256")
        key = load_pem_public_key(named.text.encode())  # settings.py took Ed25519 and RSA only
        return VerificationKey(key, "EdDSA" if isinstance(key, Ed25519PublicKey) else "RS256")


@dataclass(frozen=True)
class Verifier:
    """Checks tokens with the keys the settings name, and against the revocations."""

    keys: Mapping[str | None, VerificationKey]  # by kid; None: the single-key form
    first: VerificationKey  # for tokens that name no key
    audience: str | None
    revocations: Revocations | None = None

    @staticmethod
    def from_settings(settings: Settings, revocations: Revocations | None) -> Verifier | None:
        """None when access control is off (no key configured)."""
        named = settings.jwt_secret or settings.jwt_public_key
        if not named:
            return None
        is_secret = bool(settings.jwt_secret)
        keys = {key.kid: VerificationKey.from_setting(key, is_secret) for key in named}
        return Verifier(keys, keys[named[0].kid], settings.jwt_audience, revocations)

    def key_of(self, token: str) -> VerificationKey:
        """The key a token's kid names; AuthError(401) for an id no key has (retired)."""
        if None in self.keys:
            return self.first
        try:
            kid = jwt.get_unverified_header(token).get("kid")  # PyJWT: a string, if any
        except jwt.PyJWTError as error:
            raise AuthError(401, "invalid_token", f"token refused: {describe(error)}") from error
        if kid is None:
            return self.first
        key = self.keys.get(kid)
        if key is None:
            raise AuthError(401, "invalid_token", "the token's key (kid) is not one in use")
        return key

    def claims_of(self, token: str) -> dict[str, object]:
        """The token's claims; AuthError(401) unless it is signed by one of our keys,
        current, and not revoked."""
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthError(401, "invalid_token", "token is too long")
        key = self.key_of(token)
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm],
                audience=self.audience,
                leeway=LEEWAY_SECONDS,
                options={
                    "require": ["exp"],
                    "verify_aud": self.audience is not None,
                    "enforce_minimum_key_length": True,
                },
            )
        except jwt.ExpiredSignatureError as error:
            raise AuthError(401, "invalid_token", "token expired") from error
        except jwt.PyJWTError as error:
            raise AuthError(401, "invalid_token", f"token refused: {describe(error)}") from error
        if self.revocations is not None and self.revocations.refuses(claims):
            raise token_revoked()
        return claims

    def allows(self, token: str, action: str, path: str) -> bool:
        """Whether `token` is ours, current, not revoked, and grants `action` on `path`."""
        try:
            grants = grants_of(self.claims_of(token))
        except AuthError:
            return False
        return granted(grants, action, path)


def grants_of(claims: Mapping[str, object]) -> tuple[Grant, ...]:
    scope = claims.get("scope", "")
    if not isinstance(scope, str):
        raise AuthError(401, "invalid_token", "scope must be a space-separated string")
    return parse_scope(scope)


def token_revoked() -> AuthError:
    return AuthError(401, "invalid_token", "token revoked")


def describe(error: jwt.PyJWTError) -> str:
    """A reason for the caller that never quotes the token (PyJWT's messages do not)."""
    return " ".join(words_of(type(error)))


def load_signing_key(text: str) -> tuple[object, str]:
    """A private key (PEM text or a PEM file's path) and its algorithm, for minting."""
    key = load_pem_private_key(read_pem(text).encode(), password=None)
    if isinstance(key, Ed25519PrivateKey):
        return key, "EdDSA"
    if isinstance(key, RSAPrivateKey):
        return key, "RS256"
    raise ValueError("the private key must be Ed25519 or RSA")


def parse_ttl(text: str) -> int:
    """Seconds in `90`, `90s`, `15m`, `1h` or `7d`; ValueError for anything else."""
    match = DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 1h or 7d")
    return int(match.group(1)) * SECONDS_PER_UNIT[match.group(2)]


def mint_token(
    key: object,
    algorithm: str,
    scope: str,
    ttl_seconds: int,
    *,
    subject: str | None = None,
    audience: str | None = None,
    key_id: str | None = None,
) -> str:
    """A signed JWT with `scope`, `iat`, `exp` and a random `jti`, by which it can be
    revoked alone (and `sub`, `aud` and the `kid` header when given)."""
    parse_scope(scope, strict=True)
    now = int(time.time())
    claims: dict[str, object] = {"scope": " ".join(scope.split()), "iat": now}
    claims["exp"] = now + ttl_seconds
    claims["jti"] = secrets.token_urlsafe(16)
    if subject:
        claims["sub"] = subject
    if audience:
        claims["aud"] = audience
    headers = {"kid": key_id} if key_id else None
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


# -- the HTTP edge ------------------------------------------------------------------


class TokenOutOfQuery:
    """WSGI middleware: move `access_token` from the query string into the environ.

    Runs before Flask parses the URL, and rewrites QUERY_STRING, RAW_URI and
    REQUEST_URI in place, so no log line (ours, or gunicorn's access log, which reads
    the same environ) can print the token. Other parameters are kept byte for byte.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        query = environ.get("QUERY_STRING", "")
        if TOKEN_PARAMETER in unquote_plus(query):
            kept, tokens = [], []
            for part in query.split("&"):
                name, _, value = part.partition("=")
                if unquote_plus(name) == TOKEN_PARAMETER:
                    tokens.append(unquote_plus(value))
                else:
                    kept.append(part)
            environ[TOKEN_ENVIRON_KEY] = tokens
            environ["QUERY_STRING"] = "&".join(kept)
            for key in ("RAW_URI", "REQUEST_URI"):
                if key in environ:
                    target = environ[key].partition("?")[0]
                    environ[key] = f"{target}?{environ['QUERY_STRING']}" if kept else target
        return self.app(environ, start_response)


def bearer_token() -> str | None:
    """The token from the Authorization header or the query; None when neither has one."""
    tokens = request.environ.get(TOKEN_ENVIRON_KEY, [])
    from_header = bearer_credentials(request.headers.get("Authorization", ""))
    if len(tokens) > 1 or (tokens and from_header):
        raise AuthError(400, "invalid_request", "send one token, in one place")
    return from_header or (tokens[0] if tokens else None)


def bearer_credentials(authorization: str) -> str:
    """The token of an `Authorization: Bearer …` header; "" for any other header."""
    scheme, _, credentials = authorization.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def required_grants(anonymous_endpoints: frozenset[str]) -> list[tuple[str, str]] | None:
    """The (action, path) pairs this request needs; None when it needs no token."""
    if request.method == "OPTIONS" or request.endpoint in anonymous_endpoints:
        return None
    view_args = request.view_args or {}
    if request.endpoint == "subscriptions.action" and view_args["action"] in WAKE_TOKEN_ACTIONS:
        return None
    if not request.path.startswith(STREAM_PREFIX):
        return [("admin", request.path.lstrip("/"))]
    # The stream view's own argument, so the path checked is the path served.
    path = view_args["path"] if request.endpoint == "stream" else request.path[len(STREAM_PREFIX) :]
    if is_reserved(path):
        return [("admin", path)]
    action = ACTION_OF_METHOD.get(request.method)
    if action is None:
        return []  # a method streams do not have: 405 for anyone with a valid token
    needed = [(action, path)]
    source = request.headers.get(FORKED_FROM)
    if action == "create" and source is not None:
        try:
            needed.append(("read", parse_fork_source(source)))
        except BadRequest:
            pass  # the view refuses this source with 400 before it touches any stream
    return needed


def refusal(error: AuthError) -> Response:
    challenge = CHALLENGE if error.status == 401 and error.error == "missing_token" else (
        f'{CHALLENGE}, error="{error.error}", error_description="{error}"'
    )  # fmt: skip
    headers = {"WWW-Authenticate": challenge, "Cache-Control": "no-store"}
    return error_response(error.status, error.error, str(error), headers)


# What `keep_private` adds to an answer that names no Cache-Control of its own.
PRIVATE_ANSWER_HEADERS = (("Cache-Control", "private"), ("Vary", "Authorization"))


def register_auth(app: Flask, settings: Settings, objects: ObjectStore) -> Verifier | None:
    """Check every request's token before its view, when a key is configured; its verifier.

    Revocations are kept in `objects` and checked unless PICOMQ_REVOCATION_INTERVAL is 0.
    Other modules name endpoints that need no token with `allow_anonymous`.
    """
    app.extensions["picomq.anonymous_endpoints"] = set(ANONYMOUS_ENDPOINTS)
    app.wsgi_app = TokenOutOfQuery(app.wsgi_app)  # even when off: clients may still send one
    revocations = None
    if settings.auth_enabled and settings.revocation_interval > 0:
        revocations = Revocations(objects, settings.revocation_interval, LEEWAY_SECONDS)
    app.extensions[REVOCATIONS_KEY] = revocations
    verifier = Verifier.from_settings(settings, revocations)
    app.extensions[ACCESS_CONTROL_KEY] = verifier is not None
    if verifier is None:
        return None

    @app.before_request
    def authorize() -> Response | None:
        try:
            needed = required_grants(frozenset(app.extensions["picomq.anonymous_endpoints"]))
            if needed is None:
                return None
            token = bearer_token()
            if token is None:
                raise AuthError(401, "missing_token", "send a token: Authorization: Bearer")
            g.picomq_claims = claims = verifier.claims_of(token)
            g.picomq_grants = grants = grants_of(claims)
            for action, path in needed:
                if not granted(grants, action, path):
                    raise AuthError(403, "insufficient_scope", f"the token does not grant {action}")
        except AuthError as error:
            log.info("refused %s %s: %s", request.method, request.path, error)
            return refusal(error)
        return None

    @app.after_request
    def keep_private(response: Response) -> Response:
        """A response chosen by credentials must never be served from a shared cache."""
        if "picomq_grants" in g:
            cache_control = response.headers.get("Cache-Control", "private")
            response.headers["Cache-Control"] = cache_control.replace("public", "private")
            response.vary.add("Authorization")
        return response

    return verifier


def allow_anonymous(app: Flask, endpoint: str) -> None:
    """Let requests to `endpoint` through without a token (health checks, for example)."""
    app.extensions["picomq.anonymous_endpoints"].add(endpoint)


# -- for views that name more streams than their own path ---------------------------


def request_grants() -> tuple[Grant, ...] | None:
    """The grants of this request's token; None when access control is off.

    With access control on, a request whose token was not checked (an endpoint open to
    anyone) has no grants, so a view asking here refuses rather than trusts it.
    """
    if not current_app.extensions[ACCESS_CONTROL_KEY]:
        return None
    return g.get("picomq_grants", ())


def request_allows(action: str, path: str) -> bool:
    """Whether this request's token grants `action` on `path` (always, with control off)."""
    grants = request_grants()
    return grants is None or granted(grants, action, path)


def request_covers(action: str, pattern: str) -> bool:
    """Whether one grant of this request's token allows `action` on all `pattern` matches."""
    grants = request_grants()
    return grants is None or any(grant.covers(action, pattern) for grant in grants)


def watch_request_token(end: Callable[[], None]) -> Callable[[], None]:
    """Call `end` if this request's token is revoked while it is served (a live read);
    the result stops watching. Nothing to watch with access control or revocations off."""
    revocations: Revocations | None = current_app.extensions[REVOCATIONS_KEY]
    claims = g.get("picomq_claims")
    if revocations is None or claims is None:
        return do_nothing
    return revocations.watch(claims, end)


def do_nothing() -> None:
    pass
