"""Members that stop, die or pause while their log holds acknowledged appends.

Real PicoMQ nodes (gunicorn, one worker each) on one storage root: each claims the
partitions it is asked about first and serves their streams through its log; the others
forward to it. The hazards of a shared log, each shown end to end: a node killed before
its log is rewritten, a node that dies and never comes back, a node paused past its
lease while clients write through another, and a log PUT whose answer is lost.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import ProxiedS3, Server, StartServer, follow_stream

from log import SHAPED_RECORD_BYTES

TEXT = "text/plain"
LEASE_SECONDS = 1.5
# Held in the log for the whole test unless said otherwise: nothing is rewritten.
NODE_ENV = {"PICOMQ_LEASE_SECONDS": str(LEASE_SECONDS), "PICOMQ_REWRITE_SECONDS": "3600"}
TAKEOVER_DEADLINE_SECONDS = 30.0


def append(
    server: Server, path: str, data: bytes, seq: int, producer: str = "p", timeout: float = 20.0
) -> int:
    """POST one append as `producer`, epoch 0, sequence `seq`: its status (0: no answer)."""
    headers = {
        "Content-Type": TEXT,
        "Producer-Id": producer,
        "Producer-Epoch": "0",
        "Producer-Seq": str(seq),
    }
    try:
        return requests.post(server.stream_url(path), data=data, headers=headers,
                             timeout=timeout).status_code  # fmt: skip
    except requests.RequestException:
        return 0


def read(server: Server, path: str) -> bytes:
    answer = requests.get(server.stream_url(path), params={"offset": "-1"}, timeout=20)
    assert answer.status_code == 200, answer.text
    return answer.content


def read_when_served(server: Server, path: str) -> bytes:
    """Read through `server`, retrying the 503s a takeover answers until it is done."""
    deadline = time.monotonic() + TAKEOVER_DEADLINE_SECONDS
    while True:
        answer = requests.get(server.stream_url(path), params={"offset": "-1"}, timeout=20)
        if answer.status_code == 200 or time.monotonic() > deadline:
            assert answer.status_code == 200, answer.text
            return answer.content
        assert answer.status_code == 503, answer.text
        time.sleep(0.2)


def create(server: Server, path: str) -> None:
    answer = requests.put(server.stream_url(path), headers={"Content-Type": TEXT}, timeout=20)
    assert answer.status_code == 201, answer.text


def log_objects(data_dir: Path) -> list[Path]:
    return sorted(path for path in (data_dir / "log").rglob("*") if path.is_file())


def segments(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("streams/*/*/seg/*"))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_appends_held_in_the_log_survive_kill_9(
    start_server: StartServer, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "s3":
        s3 = request.getfixturevalue("s3_storage")
        node = start_server(storage_url=s3.url, workers=1, env={**NODE_ENV, **s3.env})
    else:
        node = start_server(workers=1, env=NODE_ENV)
    paths = [f"kill9-{number}" for number in range(10)]
    for path in paths:
        create(node, path)
        for seq in range(3):
            assert append(node, path, b"%s/%d;" % (path.encode(), seq), seq) == 200
    if backend == "local":
        assert log_objects(node.data_dir) and not segments(node.data_dir)  # all in the log
    node.kill9()
    node.start()
    for path in paths:
        expected = b"".join(b"%s/%d;" % (path.encode(), seq) for seq in range(3))
        assert read_when_served(node, path) == expected
        assert append(node, path, b"again;", 2) == 204  # the producer's state came back too


def test_large_appends_linked_or_only_logged_survive_kill_9(start_server: StartServer) -> None:
    """On local disk a large append's log object is its segment, linked into place at
    the rewrite (log.py): kill -9 with some appends linked and the last only logged,
    and the restart serves each once, its producer state with it."""
    node = start_server(workers=1, env=NODE_ENV)
    create(node, "large")
    chunks = [(b"%04d;" % number) * (SHAPED_RECORD_BYTES // 5 + 1) for number in range(70)]
    linked = 4 * 1024 * 1024 // len(chunks[0]) + 1  # past 4 MiB: the stream is rewritten
    for seq, chunk in enumerate(chunks[:linked]):
        assert append(node, "large", chunk, seq) == 200
    deadline = time.monotonic() + TAKEOVER_DEADLINE_SECONDS
    while not segments(node.data_dir):
        assert time.monotonic() < deadline, "the stream's records were never rewritten"
        time.sleep(0.1)
    for seq in range(linked, len(chunks)):
        assert append(node, "large", chunks[seq], seq) == 200
    node.kill9()
    node.start()
    read_when_served(node, "large")  # once replayed; a read holds 4 MiB at most
    reads = follow_stream(node.stream_url("large"), max_reads=10, timeout=20)
    served = b""
    for answer in reads:
        served += answer.content
        if answer.headers.get("Stream-Up-To-Date") == "true":
            break
    assert served == b"".join(chunks)
    assert append(node, "large", chunks[-1], len(chunks) - 1) == 204  # a duplicate


def test_a_dead_nodes_appends_are_served_by_another(start_server: StartServer) -> None:
    first = start_server(workers=1, env=NODE_ENV)
    second = start_server(storage_url=str(first.data_dir), workers=1, env=NODE_ENV)
    create(first, "dies")  # the first node is asked first: it serves the stream
    for seq in range(5):
        assert append(first, "dies", b"%d;" % seq, seq) == 200
    assert not segments(first.data_dir)
    first.kill9()  # and never comes back
    assert read_when_served(second, "dies") == b"0;1;2;3;4;"
    assert append(second, "dies", b"5;", 5) == 200


def test_a_paused_node_acknowledges_nothing_another_contradicts(
    start_server: StartServer,
) -> None:
    paused = start_server(workers=1, env=NODE_ENV)
    other = start_server(storage_url=str(paused.data_dir), workers=1, env=NODE_ENV)
    create(paused, "paused")  # the paused node serves the stream
    acknowledged: list[bytes] = []  # appends a node answered 200: stored, once
    unanswered: list[bytes] = []  # appends no node acknowledged: stored once or not at all

    class Producer:
        """A producer that retries an unacknowledged sequence number with the same data,
        as a client does: a 204 is then its earlier try, stored."""

        def __init__(self, name: str) -> None:
            self.name, self.seq = name, 0

        def write(self, server: Server) -> None:
            data = b"%s-%d;" % (self.name.encode(), self.seq)
            status = append(server, "paused", data, self.seq, producer=self.name)
            if status in (200, 204):
                acknowledged.append(data)
                self.seq += 1
            elif data not in unanswered:
                unanswered.append(data)

    steady, stopped = Producer("steady"), Producer("stopped")
    for _ in range(3):
        steady.write(paused)
    in_flight = threading.Thread(target=stopped.write, args=(paused,))
    os.killpg(paused.pid, signal.SIGSTOP)
    try:
        in_flight.start()  # reaches the paused node, answered, if ever, once it resumes
        time.sleep(0.5)
        deadline = time.monotonic() + TAKEOVER_DEADLINE_SECONDS
        while steady.seq < 6:
            assert time.monotonic() < deadline, "the other node never took the stream over"
            steady.write(other)  # forwarded to the paused owner until its lease ends
    finally:
        os.killpg(paused.pid, signal.SIGCONT)
    in_flight.join(timeout=60)
    while steady.seq < 9:
        assert time.monotonic() < deadline + 60, "the resumed node never answered"
        steady.write(paused)  # served by the other node now, through either

    final = read(other, "paused")
    assert read(paused, "paused") == final  # one order, whichever node reads
    for data in acknowledged:
        assert final.count(data) == 1, (data, final)
    for data in unanswered:
        assert final.count(data) <= 1, (data, final)
    assert final.count(b"steady-") == 9
    assert "replayed" in other.output()  # it took the stream over: fenced, then replayed
    assert "retires" in paused.output()  # resumed, it found its log fenced and gave up


def test_a_log_put_whose_answer_is_lost_is_stored_once(
    start_server: StartServer, proxied_s3: ProxiedS3
) -> None:
    node = start_server(storage_url=proxied_s3.url, workers=1, env={**NODE_ENV, **proxied_s3.env})
    create(node, "lost")
    assert append(node, "lost", b"0;", 0) == 200
    proxied_s3.proxy.set_faults(
        drop_fraction=1.0, after_forward=True, methods=frozenset({"PUT"}),
        path_contains="/log/", limit=1,
    )  # fmt: skip
    statuses = [append(node, "lost", b"1;", 1)]
    if statuses[0] != 200:  # the answer lost past every retry: the client retries
        statuses.append(append(node, "lost", b"1;", 1))
    assert statuses[-1] in (200, 204)
    assert proxied_s3.proxy.injected()["drop"] == 1
    assert read_when_served(node, "lost") == b"0;1;"
