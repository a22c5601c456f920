"""Forwarding's connections to peers: never reused into a peer's idle deadline."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest
import urllib3
from conftest import REPO_DIR
from loopback_listener import LoopbackListener

import forwarding
from forwarding import PeerPool

# The fake peer's idle deadline, and how long the pool may keep a connection idle here.
PEER_DEADLINE_SECONDS = 0.6
POOL_IDLE_SECONDS = 0.3
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class IdleClosingPeer(LoopbackListener):
    """A peer listener that, like worker.py's, ends a connection idle for longer than its
    deadline; it notices only when the next request arrives, the moment a real peer's
    timer and a request can meet, and closes without reading or answering it."""

    def __init__(self) -> None:
        self.answered = 0
        super().__init__()

    def serve(self, connection: socket.socket) -> None:
        idle_since = time.monotonic()
        with connection:
            while connection.recv(65536):  # a whole small request per read, on loopback
                if time.monotonic() - idle_since > PEER_DEADLINE_SECONDS:
                    return  # closed with the request unanswered
                self.answered += 1  # before the answer: the test reads it once answered
                connection.sendall(ANSWER)
                idle_since = time.monotonic()


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> Iterator[IdleClosingPeer]:
    monkeypatch.setattr(forwarding, "PEER_IDLE_SECONDS", POOL_IDLE_SECONDS)
    started = IdleClosingPeer()
    yield started
    started.close()


def get(pool: urllib3.HTTPConnectionPool) -> int:
    return pool.urlopen("GET", "/", retries=False, timeout=5.0).status


def test_a_connection_idle_past_the_peers_deadline_is_not_reused(peer: IdleClosingPeer) -> None:
    pool = PeerPool("127.0.0.1", peer.port, maxsize=4, block=False)
    assert get(pool) == 200
    assert get(pool) == 200  # at once: the same connection
    assert peer.connections == 1
    time.sleep(PEER_DEADLINE_SECONDS + 0.2)  # idle past both deadlines, not yet ended
    assert get(pool) == 200
    assert (peer.connections, peer.answered) == (2, 3)


def test_the_peer_really_drops_a_request_on_a_connection_idle_too_long(
    peer: IdleClosingPeer,
) -> None:
    """What the pool avoids, with urllib3's own pool: the request is lost unanswered."""
    pool = urllib3.HTTPConnectionPool("127.0.0.1", peer.port, maxsize=4, block=False)
    assert get(pool) == 200
    time.sleep(PEER_DEADLINE_SECONDS + 0.2)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        get(pool)


def test_connections_to_peers_retire_before_the_peers_keepalive_ends_them() -> None:
    config = (REPO_DIR / "gunicorn.conf.py").read_text()
    keepalive = float(re.search(r"^keepalive = ([0-9.]+)", config, re.MULTILINE).group(1))
    assert forwarding.PEER_IDLE_SECONDS <= keepalive / 2
