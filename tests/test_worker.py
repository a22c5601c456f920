"""The gunicorn worker (worker.py): every byte of a write arrives, in order, once.

The eager send takes what the kernel accepts at once and leaves the rest to gevent's
sendall; these tests make the kernel take only part of a write, so both halves run.
"""

from __future__ import annotations

import socket

import gevent
import requests
from conftest import Server
from gevent import socket as gevent_socket

from worker import EagerSendSocket

SMALL_SEND_BUFFER = 4096


def connected_pair() -> tuple[gevent_socket.socket, gevent_socket.socket]:
    """A loopback TCP connection: (the side that will send eagerly, the reading side)."""
    listener = gevent_socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    reader = gevent_socket.create_connection(listener.getsockname())
    sender, _ = listener.accept()
    listener.close()
    sender.__class__ = EagerSendSocket
    return sender, reader


def read_exactly(reader: gevent_socket.socket, size: int) -> bytes:
    chunks, received = [], 0
    while received < size:
        chunk = reader.recv(min(65536, size - received))
        assert chunk, "connection closed early"
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def test_a_write_larger_than_the_send_buffer_arrives_whole_and_in_order() -> None:
    sender, reader = connected_pair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_SEND_BUFFER)
    data = bytes(range(256)) * (8 * 1024 * 1024 // 256)  # 8 MiB: many buffers' worth
    receiving = gevent.spawn(read_exactly, reader, len(data))
    with gevent.Timeout(30):
        sender.sendall(data)
        assert receiving.get() == data
    sender.close()
    reader.close()


def test_small_writes_arrive_in_order_without_waiting() -> None:
    sender, reader = connected_pair()
    events = [f"event: data\ndata:[{n}]\n\n".encode() for n in range(1000)]
    with gevent.Timeout(30):
        for event in events:
            sender.sendall(event)  # no reader yet: each must fit the kernel's buffer
        assert read_exactly(reader, sum(map(len, events))) == b"".join(events)
    sender.close()
    reader.close()


def test_a_write_to_a_closed_peer_raises() -> None:
    sender, reader = connected_pair()
    reader.close()
    with gevent.Timeout(30):
        try:
            for _ in range(1000):
                sender.sendall(b"x" * 65536)
        except OSError:
            return
        finally:
            sender.close()
    raise AssertionError("64 MiB sent to a closed peer without an error")


def test_the_server_runs_this_worker(server: Server) -> None:
    assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200
    assert "Using worker: worker.EagerSendWorker" in server.managed.output()
