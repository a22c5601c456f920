"""Routes for operators and tools, outside the stream namespace `/v1/stream/`.

- `/healthz`: the process is up and serving (no I/O).
- `/readyz`: storage answers; 503 when it does not, so a balancer stops sending.
- `/metrics`: Prometheus text format (see metrics.py).
- `/v1/streams?prefix=&after=&limit=`: the listing extension, paged JSON. It is not a
  stream path (those all start `/v1/stream/`), so it can never shadow one.
- `POST /v1/revocations`: revoke tokens by `jti` or `sub` (revocations.py).
- `/`: the web inspector, a static page from `static/`.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import secrets

import gevent
import orjson
from flask import Flask, Response, current_app, request

from auth import REVOCATIONS_KEY, allow_anonymous
from logs import echo_and_log, start_request, use_json_logs, use_text_logs
from metrics import (
    count_request_start,
    count_response,
    get_metrics,
    metrics_view,
)
from objectstore import StorageUnavailable
from protocol import (
    NO_STORE,
    BadRequest,
    error_response,
    format_offset,
    json_response,
    parse_number,
    storage_unavailable_response,
)
from revocations import KINDS, RevocationRefused, Revocations
from settings import Settings
from storage import StreamStore
from streams import StoreError, StreamGone, StreamInfo, StreamNotFound

log = logging.getLogger("picomq.ops")

READINESS_KEY = "streams"  # one HEAD (S3) or stat (disk) of the streams prefix
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_PREFIX_BYTES = 1024
MAX_REVOCATION_BODY_BYTES = 4096
INSPECTOR_PAGE = "inspector.html"
NOT_CACHED = {"Cache-Control": NO_STORE}  # what ops answers is true only now
# Scripts and styles by this response's nonce alone: 'self' would trust every URL of
# this origin, stream reads included, whose bodies anyone who may append writes.
INSPECTOR_POLICY = (
    "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}';"
    " connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self';"
    " frame-ancestors 'none'"
)


def register_operations(app: Flask, store: StreamStore, settings: Settings) -> None:
    """Add the routes above, request metrics, request ids and (if set) JSON logs."""
    if settings.log_format == "json":
        use_json_logs()
    else:
        use_text_logs()
    install_request_hooks(app, store)
    allow_anonymous(app, "static")  # the inspector's script and style hold no data
    app.add_url_rule("/healthz", "healthz", healthz, methods=["GET", "HEAD"])
    app.add_url_rule("/readyz", "readyz", readyz, methods=["GET", "HEAD"])
    app.add_url_rule("/metrics", "metrics", metrics_view, methods=["GET"])
    app.add_url_rule("/v1/streams", "list_streams", list_streams, methods=["GET"])
    app.add_url_rule("/v1/revocations", "revoke", revoke, methods=["POST"])
    app.add_url_rule("/", "inspector", inspector, methods=["GET", "HEAD"])
    if store.settings.sweep_interval > 0:  # off by default on object stores: see create_store
        gevent.spawn(sweep_forever, store, store.settings.sweep_interval)


def sweep_forever(store: StreamStore, interval: float) -> None:
    """Every `interval` seconds, in every worker, sweep out expired streams,
    soft-deleted ones that no fork reads any more, and folders no stream uses."""
    while True:
        gevent.sleep(interval * random.uniform(0.75, 1.25))  # workers and nodes spread out
        try:
            store.sweep()
        except StorageUnavailable as error:
            log.warning("sweep postponed: %s", error)
        except Exception:  # noqa: BLE001 - a background job logs and goes on
            log.exception("sweep failed")


def install_request_hooks(app: Flask, store: StreamStore) -> None:
    """One hook per request phase for both logs and metrics (each hook costs a call)."""
    metrics = get_metrics()
    observe_batch_size = functools.partial(metrics.writes.observe, metrics.commit_batch_size)
    store.commit_observers.append(observe_batch_size)

    @app.before_request
    def before() -> None:
        start_request()
        count_request_start(metrics)

    @app.after_request
    def after(response: Response) -> Response:
        count_response(metrics, response)
        echo_and_log(response)
        return response


def healthz() -> Response:
    return json_response({"status": "ok"}, 200, NOT_CACHED)


def readyz() -> Response:
    """Ready when storage answers one cheap request; the reason when it does not."""
    objects = current_app.extensions["picomq.store"].objects
    try:
        objects.identity(READINESS_KEY)
        if objects.is_local and not os.access(objects.root, os.W_OK | os.X_OK):
            raise StorageUnavailable(f"{objects.root} is not writable")
    except (StorageUnavailable, OSError) as error:
        log.warning("not ready: %s", error)
        return json_response(
            {"status": "unavailable", "reason": "storage is unreachable"}, 503, NOT_CACHED
        )
    return json_response({"status": "ready"}, 200, NOT_CACHED)


def list_streams() -> Response:
    """One page of streams whose path starts with `prefix`, in path order.

    `after` is the last path of the previous page (the `next` of the answer), so pages
    stay consistent while streams come and go. Each listed stream is read with `head`,
    so a page costs at most `limit` stream loads.
    """
    try:
        prefix, after, limit = parse_listing()
    except BadRequest as error:
        return error_response(400, "bad_request", str(error))
    store: StreamStore = current_app.extensions["picomq.store"]
    try:
        candidates = sorted(path for path in store.paths() if path.startswith(prefix))
        candidates = [path for path in candidates if after is None or path > after]
        streams, more = page_of(store, candidates, limit)
    except StorageUnavailable:
        return storage_unavailable_response()
    next_after = streams[-1]["path"] if more else None
    return json_response({"streams": streams, "next": next_after}, 200, NOT_CACHED)


def page_of(store: StreamStore, paths: list[str], limit: int) -> tuple[list[dict], bool]:
    """The first `limit` streams of `paths` that still exist, and whether another does.

    Deleted streams may linger in the listing; they are skipped, so a page never ends
    with a `next` that leads to an empty page.
    """
    streams: list[dict] = []
    for path in paths:
        try:
            info = store.head(path)
        except (StreamNotFound, StreamGone):
            continue  # deleted (or expired) since the listing
        except StoreError as error:  # one stream that cannot be served never breaks a page
            log.warning("listing skipped %s: %s", path, error)
            continue
        if len(streams) == limit:
            return streams, True
        streams.append(format_stream(info))
    return streams, False


def parse_listing() -> tuple[str, str | None, int]:
    prefix = request.args.get("prefix", "")
    if len(prefix.encode()) > MAX_PREFIX_BYTES:
        raise BadRequest(f"prefix is longer than {MAX_PREFIX_BYTES} bytes")
    limit_text = request.args.get("limit")
    limit = DEFAULT_PAGE_SIZE
    if limit_text is not None:
        limit = parse_number("limit", limit_text, MAX_PAGE_SIZE)
        if limit == 0:
            raise BadRequest(f"limit must be between 1 and {MAX_PAGE_SIZE}")
    return prefix, request.args.get("after"), limit


def format_stream(info: StreamInfo) -> dict[str, object]:
    return {
        "path": info.path,
        "contentType": info.content_type,
        "bytes": info.tail,
        "nextOffset": format_offset(info.tail),
        "closed": info.closed,
        "ttl": info.ttl,
        "expiresAt": info.expires_at,
    }


def revoke() -> Response:
    """`{"jti": …, "until": …}` or `{"sub": …, "until": …}`, until in unix seconds: refuse
    that token, or that subject's tokens issued until now, everywhere within
    PICOMQ_REVOCATION_INTERVAL. 201 with the revocation and when it was made."""
    revocations: Revocations | None = current_app.extensions[REVOCATIONS_KEY]
    if revocations is None:
        return error_response(
            409, "revocations_off", "this server checks no revocations: access control is off,"
            " or PICOMQ_REVOCATION_INTERVAL is 0",
        )  # fmt: skip
    try:
        kind, value, until = parse_revocation(request.get_data())
        revocation = revocations.revoke(kind, value, until)
    except BadRequest as error:
        return error_response(400, "bad_request", str(error))
    except RevocationRefused as error:
        return error_response(400, error.code, str(error))
    except StorageUnavailable:
        return storage_unavailable_response()
    return json_response({kind: value, "until": until, "at": revocation.at}, 201, NOT_CACHED)


def parse_revocation(data: bytes) -> tuple[str, str, int]:
    """The kind (jti or sub), its value and `until` of a revocation's JSON body."""
    shape = 'the body must be {"jti": "…", "until": …} or {"sub": "…", "until": …}'
    if len(data) > MAX_REVOCATION_BODY_BYTES:
        raise BadRequest(f"the body is larger than {MAX_REVOCATION_BODY_BYTES} bytes")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise BadRequest(shape) from None
    kinds = [kind for kind in KINDS if isinstance(body, dict) and kind in body]
    if len(kinds) != 1 or set(body) != {kinds[0], "until"}:
        raise BadRequest(shape)
    kind, until = kinds[0], body["until"]
    if not isinstance(body[kind], str):
        raise BadRequest(f"{kind} must be a string")
    if type(until) is not int:
        raise BadRequest("until must be a whole number of unix seconds (the tokens' exp)")
    return kind, body[kind], until


def inspector() -> Response:
    """The page, its own script and stylesheet marked with a nonce made for this answer
    (never cached: a cached page would carry an old nonce)."""
    nonce = secrets.token_urlsafe(16)
    page = inspector_page(current_app.static_folder)
    marked = page.replace("<script ", f'<script nonce="{nonce}" ').replace(
        "<link ", f'<link nonce="{nonce}" '
    )
    headers = {
        "Content-Security-Policy": INSPECTOR_POLICY.format(nonce=nonce),
        "Cache-Control": "no-store",
    }
    return Response(marked, 200, headers, mimetype="text/html")


@functools.cache
def inspector_page(folder: str) -> str:
    with open(os.path.join(folder, INSPECTOR_PAGE), encoding="utf-8") as page:
        return page.read()
