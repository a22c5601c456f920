"""Peers: what members ask one another, beside the clients' requests they forward.

A subscription is served by one member and the streams it links by theirs (members.py),
so subscriptions.py asks other members for a few things: the tails of streams they
serve, a wake event appended to a wake stream they serve, news of a stream that grew
for the member that serves a subscription linking it, and word of a subscription
created, changed or deleted for every member that serves streams (directory.py). Each
is a POST of a JSON object to /_peer/<name> on the member's peer listener, answered
with a JSON object. A member asked about what it does not serve answers 421, and the
asker reads the claims again and asks once more, as forwarding.py does for clients.

Peer routes take no client token: they carry the peer key, 32 random bytes made once
under the storage root (cluster/peer.key), so only processes that can read storage may
call them. The key travels in the clear, as clients' tokens do over plain HTTP: peer
addresses (PICOMQ_PEER_HOST) belong on a private network.
"""

from __future__ import annotations

import functools
import hmac
import logging
import secrets
from collections.abc import Callable

import gevent
import orjson
import urllib3
from flask import Flask, request

from auth import allow_anonymous
from forwarding import CONNECT_SECONDS, MISDIRECTED, Forwarder
from members import Membership, Owner
from objectstore import ObjectStore, StorageUnavailable, read_or_create
from protocol import Response, error_response, json_response, storage_unavailable_response

log = logging.getLogger("picomq.peers")

PEER_PREFIX = "/_peer/"
KEY_OBJECT = "cluster/peer.key"
KEY_HEADER = "X-PicoMQ-Peer-Key"
ANSWER_SECONDS = 10.0  # a peer answers from memory, or after a few storage requests
TIMEOUT = urllib3.Timeout(connect=CONNECT_SECONDS, read=ANSWER_SECONDS)

PeerView = Callable[[dict], dict | None]


class PeerUnavailable(StorageUnavailable):
    """The member that serves what was asked did not answer as one, and is not dead: a
    retry may reach it (503 with Retry-After, as for storage)."""


class Peers:
    """Ask the member that serves a path, or every member that serves streams."""

    def __init__(self, membership: Membership, forwarder: Forwarder, objects: ObjectStore) -> None:
        self.membership = membership
        self.forwarder = forwarder
        self.objects = objects

    @functools.cached_property
    def key(self) -> bytes:
        """The peer key, read (or made, by the first member ever) once per process."""
        return read_or_create(self.objects, KEY_OBJECT, lambda: secrets.token_hex(32).encode())

    # -- asking -----------------------------------------------------------------------

    def ask(self, path: str, name: str, body: dict) -> dict | None:
        """The answer to `name` of the member that serves `path`; None when that is this
        process, which then serves it itself. Raises PeerUnavailable."""
        for _ in range(2):
            owner = self.membership.known_owner(path)
            if owner is None:
                return None
            answer = self.post(owner, name, body)
            if answer is not None:
                return answer
            self.membership.forget_owner(path)  # not its server (421), or dead: ask again
        raise PeerUnavailable(f"the server of {path} keeps moving; retry")

    def post(self, owner: Owner, name: str, body: dict) -> dict | None:
        """`owner`'s answer to `name`; None when it does not serve what was asked (421)
        or is dead. Raises PeerUnavailable when it is alive and does not answer."""
        headers = {"Content-Type": "application/json", KEY_HEADER: self.key.decode()}
        try:
            answer = self.forwarder.send(
                owner, "POST", PEER_PREFIX + name, headers, orjson.dumps(body), TIMEOUT
            )
            try:
                data = answer.read()
            finally:
                answer.release_conn()
        except urllib3.exceptions.HTTPError as error:
            if self.membership.owner_is_dead(owner):
                return None
            raise PeerUnavailable(f"member {owner.member} did not answer: {error}") from error
        if answer.status == MISDIRECTED:
            return None
        if answer.status != 200:
            raise PeerUnavailable(f"member {owner.member} answered {name} {answer.status}")
        return orjson.loads(data)

    def tell_all(self, name: str, body: dict) -> None:
        """Post to every other member that owns a partition, all at once; return when all
        have answered or ANSWER_SECONDS have passed. Those not reached are logged: the
        dead need not hear, and directory.py says how the others catch up."""
        if not self.membership.started:
            return
        owners = self.membership.other_owners()
        posts = [gevent.spawn(self._tell, owner, name, body) for owner in owners]
        gevent.joinall(posts, timeout=ANSWER_SECONDS + CONNECT_SECONDS)

    def _tell(self, owner: Owner, name: str, body: dict) -> None:
        try:
            self.post(owner, name, body)
        except StorageUnavailable as error:
            log.warning("member %s missed %s: %s", owner.member, name, error)

    # -- answering --------------------------------------------------------------------

    def route(self, app: Flask, name: str, view: PeerView) -> None:
        """Serve POST /_peer/<name>: the key checked, the JSON body handed to `view`, whose
        dict is the answer; None from it means "not served here" (421)."""

        def handle() -> Response:
            sent = request.headers.get(KEY_HEADER, "").encode()
            if not hmac.compare_digest(sent, self.key):
                return error_response(401, "peer_key_invalid", "peer routes need the peer key")
            try:
                body = orjson.loads(request.get_data())
                answer = view(body) if isinstance(body, dict) else {}
            except orjson.JSONDecodeError:
                return error_response(400, "bad_request", "a peer body is a JSON object")
            except StorageUnavailable as error:
                log.warning("peer %s: %s", name, error)
                return storage_unavailable_response()
            if answer is None:
                return error_response(MISDIRECTED, "misdirected", "another member serves this")
            return json_response(answer)

        endpoint = f"peers.{name}"
        app.add_url_rule(PEER_PREFIX + name, endpoint, handle, methods=["POST"])
        allow_anonymous(app, endpoint)
