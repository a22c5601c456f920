"""Durability under kill -9: what a client was told survives a crash, exactly once, in order.

Each test drives a real PicoMQ (gunicorn + gevent) over HTTP, SIGKILLs the whole process
group while requests are in flight (no graceful shutdown, nothing flushed on the way out),
starts it again on the same data directory and compares the stream with what the clients
saw: every append answered 2xx is there exactly once and in its writer's order; an append
whose answer never came may or may not be there, but at most once.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests
from conftest import follow_stream

from log import SHAPED_RECORD_BYTES, encode_log, encode_shaped, log_key, record_of
from segments import StreamState, encode_segment, positions

if TYPE_CHECKING:
    from conftest import Server, StartServer

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
JSON_TYPE = "application/json"
BYTES_TYPE = "application/octet-stream"
CLOSE_CONNECTION = {"Connection": "close"}

WRITERS = 16
# Acknowledged appends (counted over all writers) between one restart and the next kill:
# early, middle and late kills, so each round crashes a stream of a different length.
KILL_AFTER_ACKS = (40, 250, 120)
PRODUCERS = 8
PRODUCER_KILL_AFTER_ACKS = (30, 150, 60)
REQUEST_TIMEOUT_SECONDS = 15.0
ROUND_DEADLINE_SECONDS = 20.0
MAX_READS = 1000
UNEXPECTED_DISCONNECT = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)


# -- reading a whole stream --------------------------------------------------------------


def parse_position(offset: str) -> int:
    """PicoMQ's offsets end with the byte position in the stream (see storage.py)."""
    return int(offset.rsplit("_", 1)[1])


def read_stream(url: str) -> tuple[list[bytes], requests.Response]:
    """Every body from the start, following Stream-Next-Offset until Stream-Up-To-Date."""
    bodies = []
    for response in follow_stream(url, MAX_READS, REQUEST_TIMEOUT_SECONDS):
        bodies.append(response.content)
        if response.headers.get(UP_TO_DATE) == "true":
            return bodies, response
    pytest.fail(f"{url} was not up to date after {MAX_READS} reads")


def read_json_messages(url: str) -> list[dict]:
    bodies, _ = read_stream(url)
    return [message for body in bodies for message in json.loads(body)]


def read_bytes(url: str) -> bytes:
    bodies, _ = read_stream(url)
    return b"".join(bodies)


def create_stream(url: str, content_type: str, **headers: str) -> requests.Response:
    response = requests.put(
        url,
        headers={"Content-Type": content_type, **CLOSE_CONNECTION, **headers},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert response.status_code == 201, (response.status_code, response.text)
    return response


# -- writers that remember what they were told ------------------------------------------


@dataclass
class Writer:
    """One client appending numbered messages in order on its own connection."""

    writer_id: int
    content_type: str
    next_number: int = 0
    acknowledged: dict[int, str] = field(default_factory=dict)  # number -> Stream-Next-Offset
    unanswered: set[int] = field(default_factory=set)

    def body(self, number: int) -> bytes:
        if self.content_type == JSON_TYPE:
            return json.dumps({"writer": self.writer_id, "number": number}).encode()
        return record_bytes(self.writer_id, number)

    def run(self, url: str, stop: threading.Event) -> None:
        """Append until told to stop or the server goes away (the answer then never came)."""
        headers = {"Content-Type": self.content_type}
        with requests.Session() as session:
            while not stop.is_set():
                number = self.next_number
                self.next_number += 1
                try:
                    response = session.post(
                        url,
                        data=self.body(number),
                        headers=headers,
                        timeout=REQUEST_TIMEOUT_SECONDS,
                    )
                except UNEXPECTED_DISCONNECT:
                    self.unanswered.add(number)
                    return
                assert response.status_code == 204, (number, response.status_code, response.text)
                self.acknowledged[number] = response.headers[NEXT_OFFSET]


RECORD_LENGTH = len(b"00:000000\n")


def record_bytes(writer_id: int, number: int) -> bytes:
    return f"{writer_id:02d}:{number:06d}\n".encode()


def parse_records(data: bytes) -> list[tuple[int, int]]:
    assert len(data) % RECORD_LENGTH == 0, f"stream of {len(data)} bytes holds a torn record"
    records = []
    for start in range(0, len(data), RECORD_LENGTH):
        writer_id, number = data[start : start + RECORD_LENGTH].decode().strip().split(":")
        records.append((int(writer_id), int(number)))
    return records


def run_until_acknowledged(
    server: Server,
    tasks: list[Callable[[threading.Event], None]],
    count_acknowledged: Callable[[], int],
    target: int,
) -> None:
    """Run every task in its own thread; SIGKILL the server once `target` appends are acked."""
    stop = threading.Event()
    with ThreadPoolExecutor(len(tasks)) as pool:
        futures = [pool.submit(task, stop) for task in tasks]
        try:
            wait_for_acknowledgements(futures, count_acknowledged, target)
        finally:
            server.kill9()
            stop.set()
        for future in futures:
            future.result()


def wait_for_acknowledgements(
    futures: list[Future[None]], count_acknowledged: Callable[[], int], target: int
) -> None:
    deadline = time.monotonic() + ROUND_DEADLINE_SECONDS
    while count_acknowledged() < target:
        finished = [future for future in futures if future.done()]
        for future in finished:
            future.result()  # a writer that failed an assertion ends the round now
        assert not finished, "a writer stopped before the kill"
        assert time.monotonic() < deadline, (
            f"only {count_acknowledged()} of {target} appends acknowledged within "
            f"{ROUND_DEADLINE_SECONDS} s"
        )
        time.sleep(0.002)


def check_against_writers(
    stream: list[tuple[int, int]], writers: list[Writer], round_number: int
) -> None:
    """Acked: exactly once. Unanswered: at most once. Each writer's order kept. No strays."""
    context = f"after kill #{round_number + 1}"
    duplicates = [message for message, count in Counter(stream).items() if count > 1]
    assert not duplicates, f"{context}: messages stored twice: {duplicates[:10]}"
    for writer in writers:
        numbers = [number for writer_id, number in stream if writer_id == writer.writer_id]
        assert numbers == sorted(numbers), f"{context}: writer {writer.writer_id} reordered"
        lost = sorted(set(writer.acknowledged) - set(numbers))
        assert not lost, f"{context}: writer {writer.writer_id} lost acknowledged {lost[:10]}"
        strays = set(numbers) - set(writer.acknowledged) - writer.unanswered
        assert not strays, f"{context}: writer {writer.writer_id} has never-sent {strays}"
    # Offsets are never reused or rewritten: the acknowledged offsets order the messages
    # exactly as the stream does.
    acknowledged = {
        (writer.writer_id, number): offset
        for writer in writers
        for number, offset in writer.acknowledged.items()
    }
    in_stream_order = [message for message in stream if message in acknowledged]
    in_offset_order = sorted(acknowledged, key=acknowledged.__getitem__)
    assert len(set(acknowledged.values())) == len(acknowledged), f"{context}: offset reused"
    assert in_stream_order == in_offset_order, f"{context}: offsets disagree with the data"


def check_byte_positions(data: bytes, writers: list[Writer]) -> None:
    """Each acknowledged append's bytes end exactly at the offset its answer named."""
    for writer in writers:
        for number, offset in writer.acknowledged.items():
            end = parse_position(offset)
            assert data[end - RECORD_LENGTH : end] == record_bytes(writer.writer_id, number), (
                f"writer {writer.writer_id} message {number} is not at its offset {offset}"
            )


def print_round(round_number: int, stream: list[tuple[int, int]], writers: list[Writer]) -> None:
    """What the kill hit (shown with -s): answers lost in flight, and how many were stored."""
    stored = set(stream)
    unanswered = {(writer.writer_id, number) for writer in writers for number in writer.unanswered}
    print(
        f"kill #{round_number + 1}: {sum(len(writer.acknowledged) for writer in writers)} "
        f"acknowledged so far, {len(unanswered)} unanswered, "
        f"{len(unanswered & stored)} of those stored"
    )


# -- 1. concurrent writers, kill -9, restart --------------------------------------------


@pytest.mark.parametrize("workers", [1, 4], ids=["1-worker", "4-workers"])
@pytest.mark.parametrize("content_type", [JSON_TYPE, BYTES_TYPE], ids=["json", "bytes"])
def test_acknowledged_appends_survive_kill9_with_concurrent_writers(
    start_server: StartServer, unique_stream: str, content_type: str, workers: int
) -> None:
    server = start_server(workers=workers)
    url = server.stream_url(unique_stream)
    create_stream(url, content_type)
    writers = [Writer(writer_id, content_type) for writer_id in range(WRITERS)]

    def count_acknowledged() -> int:
        return sum(len(writer.acknowledged) for writer in writers)

    for round_number, kill_after in enumerate(KILL_AFTER_ACKS):
        tasks = [lambda stop, writer=writer: writer.run(url, stop) for writer in writers]
        target = count_acknowledged() + kill_after
        run_until_acknowledged(server, tasks, count_acknowledged, target)
        server.start()
        if content_type == JSON_TYPE:
            messages = read_json_messages(url)
            stream = [(message["writer"], message["number"]) for message in messages]
        else:
            data = read_bytes(url)
            stream = parse_records(data)
            check_byte_positions(data, writers)
        check_against_writers(stream, writers, round_number)
        print_round(round_number, stream, writers)


# -- 2. idempotent producers across a crash ------------------------------------------------


@dataclass
class IdempotentProducer:
    """Sends seq 0, 1, 2, ... one at a time, as a Durable Streams idempotent producer."""

    producer_id: str
    next_seq: int = 0
    last_acknowledged: int | None = None
    unanswered: int | None = None

    def post(self, session: requests.Session, url: str, seq: int) -> requests.Response:
        return session.post(
            url,
            data=json.dumps({"producer": self.producer_id, "seq": seq}),
            headers={
                "Content-Type": JSON_TYPE,
                "Producer-Id": self.producer_id,
                "Producer-Epoch": "0",
                "Producer-Seq": str(seq),
            },
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    def run(self, url: str, stop: threading.Event) -> None:
        with requests.Session() as session:
            while not stop.is_set():
                seq = self.next_seq
                try:
                    response = self.post(session, url, seq)
                except UNEXPECTED_DISCONNECT:
                    self.unanswered = seq
                    return
                assert response.status_code == 200, (seq, response.status_code, response.text)
                assert response.headers["Producer-Seq"] == str(seq)
                self.last_acknowledged, self.next_seq = seq, seq + 1

    def recover(self, url: str, stored: set[int]) -> None:
        """Retry the last acknowledged seq and the unanswered one; the data decides the answer.

        The producer state is committed with the data, so the retry of a stored seq is a
        duplicate (204, naming the highest stored seq) and an unstored one is appended (200).
        """
        highest_stored = max(stored, default=None)
        with requests.Session() as session:
            if self.last_acknowledged is not None:
                response = self.post(session, url, self.last_acknowledged)
                assert response.status_code == 204, (response.status_code, response.text)
                assert response.headers["Producer-Seq"] == str(highest_stored), (
                    f"{self.producer_id}: producer state says seq "
                    f"{response.headers['Producer-Seq']}, the data ends at {highest_stored}"
                )
            if self.unanswered is not None:
                response = self.post(session, url, self.unanswered)
                expected = 204 if self.unanswered in stored else 200
                assert response.status_code == expected, (
                    f"{self.producer_id}: retry of seq {self.unanswered} "
                    f"({'stored' if expected == 204 else 'not stored'}) answered "
                    f"{response.status_code} {response.text}"
                )
                self.last_acknowledged, self.next_seq = self.unanswered, self.unanswered + 1
                self.unanswered = None


def seqs_by_producer(url: str) -> dict[str, list[int]]:
    result: dict[str, list[int]] = {}
    for message in read_json_messages(url):
        result.setdefault(message["producer"], []).append(message["seq"])
    return result


def test_idempotent_producer_retries_after_kill9_store_each_seq_once(
    start_server: StartServer, unique_stream: str
) -> None:
    server = start_server()
    url = server.stream_url(unique_stream)
    create_stream(url, JSON_TYPE)
    producers = [IdempotentProducer(f"producer-{number}") for number in range(PRODUCERS)]

    def count_acknowledged() -> int:
        return sum(producer.next_seq for producer in producers)

    for kill_after in PRODUCER_KILL_AFTER_ACKS:
        tasks = [lambda stop, producer=producer: producer.run(url, stop) for producer in producers]
        run_until_acknowledged(server, tasks, count_acknowledged, count_acknowledged() + kill_after)
        server.start()
        stored = seqs_by_producer(url)
        for producer in producers:
            seqs = stored.get(producer.producer_id, [])
            assert seqs == list(range(len(seqs))), f"{producer.producer_id}: {seqs}"
            acknowledged = -1 if producer.last_acknowledged is None else producer.last_acknowledged
            assert acknowledged < len(seqs), f"{producer.producer_id} lost seq {acknowledged}"
            producer.recover(url, set(seqs))

    stored = seqs_by_producer(url)
    for producer in producers:
        assert stored.get(producer.producer_id, []) == list(range(producer.next_seq)), (
            f"{producer.producer_id}: stream holds {stored.get(producer.producer_id)}"
        )


# -- 3. the closed flag ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close-request", "close-with-last-append", "created-closed"])
def test_closed_stream_stays_closed_after_kill9(
    start_server: StartServer, unique_stream: str, how: str
) -> None:
    server = start_server()
    url = server.stream_url(unique_stream)
    text = {"Content-Type": "text/plain", **CLOSE_CONNECTION}
    if how == "created-closed":
        closing = requests.put(
            url, data=b"first\n", headers={**text, CLOSED: "true"}, timeout=REQUEST_TIMEOUT_SECONDS
        )
        assert closing.status_code == 201, closing.text
        expected = b"first\n"
    else:
        create_stream(url, "text/plain")
        first = requests.post(url, data=b"first\n", headers=text, timeout=REQUEST_TIMEOUT_SECONDS)
        assert first.status_code == 204, first.text
        last = b"last\n" if how == "close-with-last-append" else b""
        closing = requests.post(
            url, data=last, headers={**text, CLOSED: "true"}, timeout=REQUEST_TIMEOUT_SECONDS
        )
        assert closing.status_code == 204, closing.text
        expected = b"first\n" + last
    assert closing.headers.get(CLOSED) == "true"
    tail = closing.headers[NEXT_OFFSET]

    server.kill9()
    server.start()

    head = requests.head(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
    assert head.status_code == 200
    assert head.headers.get(CLOSED) == "true", "the stream reopened after kill -9"
    assert head.headers[NEXT_OFFSET] == tail
    refused = requests.post(url, data=b"after\n", headers=text, timeout=REQUEST_TIMEOUT_SECONDS)
    assert refused.status_code == 409, (refused.status_code, refused.text)
    assert refused.headers.get(CLOSED) == "true"
    assert refused.headers.get(NEXT_OFFSET) == tail
    bodies, last_read = read_stream(url)
    assert b"".join(bodies) == expected
    assert last_read.headers.get(CLOSED) == "true"


@dataclass
class ClosedAwareWriter(Writer):
    """A writer that stops at its first 409 Stream-Closed (the append was refused)."""

    def run(self, url: str, stop: threading.Event) -> None:
        headers = {"Content-Type": self.content_type}
        with requests.Session() as session:
            while not stop.is_set():
                number = self.next_number
                self.next_number += 1
                response = session.post(
                    url, data=self.body(number), headers=headers, timeout=REQUEST_TIMEOUT_SECONDS
                )
                if response.status_code == 409:
                    assert response.headers.get(CLOSED) == "true", response.text
                    return
                assert response.status_code == 204, (number, response.status_code, response.text)
                self.acknowledged[number] = response.headers[NEXT_OFFSET]


def test_close_racing_appends_survives_kill9(start_server: StartServer, unique_stream: str) -> None:
    """Writers keep appending while the stream is closed, then the server dies.

    After the restart the stream is closed at the offset the close answered, every append
    acknowledged before the close is there, and nothing follows the close.
    """
    server = start_server()
    url = server.stream_url(unique_stream)
    create_stream(url, BYTES_TYPE)
    writers = [ClosedAwareWriter(writer_id, BYTES_TYPE) for writer_id in range(WRITERS)]
    stop = threading.Event()
    with ThreadPoolExecutor(WRITERS) as pool:
        futures = [pool.submit(writer.run, url, stop) for writer in writers]
        wait_for_acknowledgements(
            futures, lambda: sum(len(writer.acknowledged) for writer in writers), 100
        )
        closing = requests.post(
            url,
            headers={CLOSED: "true", **CLOSE_CONNECTION},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        assert closing.status_code == 204, closing.text
        for future in futures:
            future.result()  # each writer stops at its first 409
        server.kill9()
    tail = closing.headers[NEXT_OFFSET]

    server.start()
    head = requests.head(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
    assert head.headers.get(CLOSED) == "true", "the stream reopened after kill -9"
    assert head.headers[NEXT_OFFSET] == tail
    data = read_bytes(url)
    assert len(data) == parse_position(tail)
    check_against_writers(parse_records(data), writers, 0)
    check_byte_positions(data, writers)


# -- 4. a torn tail left by a crash -----------------------------------------------------


def stream_prefix(server: Server) -> Path:
    """The one stream's folder (streams/<key>/<incarnation>: docs/storage.md)."""
    folders = [path for path in server.data_dir.glob("streams/*/*") if path.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def log_directory(server: Server) -> Path:
    """The log of the server's one member (docs/shared-log.md)."""
    members = [path for path in (server.data_dir / "log").iterdir() if path.is_dir()]
    assert len(members) == 1, members
    return members[0]


TEARS = ["empty", "torn-in-header", "torn-in-payload", "payload-never-written", "all-zeros"]


def torn(whole: bytes, header_end: int, how: str) -> bytes:
    """What a crash in the middle of writing `whole` (a header of `header_end` bytes,
    then a payload) could leave under its name."""
    return {
        "empty": b"",
        "torn-in-header": whole[: header_end // 2],
        "torn-in-payload": whole[: header_end + (len(whole) - header_end) // 2],
        # Linked before its data was synced (localdisk.publish_then_sync): the size
        # may reach the disk without the blocks, which read back as zeros.
        "payload-never-written": whole[:header_end] + bytes(len(whole) - header_end),
        "all-zeros": bytes(len(whole)),
    }[how]


def segment_at(position: int, payload: bytes) -> tuple[bytes, int]:
    """A whole segment at `position` holding `payload`, and where its payload begins."""
    state = StreamState(tail=position + len(payload))
    whole, _ = encode_segment(position, payload, positions([len(payload)]), positions(), state)
    return whole, len(whole) - len(payload)


def tear_next_log_object(
    server: Server, path: str, position: int, how: str, *, shaped: bool
) -> None:
    """The member's next log object, holding a commit never acknowledged, torn: a flush
    of one large record is shaped as its segment (log.py)."""
    directory = log_directory(server)
    numbers = [int(name.name) for name in directory.iterdir() if name.name.isdigit()]
    payload = b"never acknowledged\n" * (SHAPED_RECORD_BYTES // 19 + 1 if shaped else 1)
    segment, _ = segment_at(position, payload)
    prefix = str(stream_prefix(server).relative_to(server.data_dir))
    record = record_of(path, prefix, segment)
    if shaped:
        whole, index = encode_shaped("0" * 32, record)
        header_end = index.payload_position
    else:
        whole = encode_log("0" * 32, [record])
        header_end = len(whole) - (4 + len(payload))  # the record's one append end, payload
    next_object = server.data_dir / log_key(directory.name, max(numbers) + 1)
    next_object.write_bytes(torn(whole, header_end, how))
    (directory / ".tmp-0123456789abcdef0123456789abcdef").write_bytes(b"half a log")


def tear_first_rewrite(server: Server, acknowledged: bytes, how: str) -> None:
    """The stream's first segment, which a rewrite of its logged commits was writing,
    torn: the log still holds them."""
    directory = stream_prefix(server) / "seg"
    directory.mkdir(exist_ok=True)
    whole, header_end = segment_at(0, acknowledged)
    (directory / f"{0:020d}").write_bytes(torn(whole, header_end, how))
    (directory / ".tmp-0123456789abcdef0123456789abcdef").write_bytes(b"half a segm")


@pytest.mark.parametrize("how", TEARS)
@pytest.mark.parametrize("where", ["log", "shaped log", "rewrite"])
def test_a_tail_torn_by_a_crash_is_dropped(
    start_server: StartServer, unique_stream: str, where: str, how: str
) -> None:
    """kill -9 with every acknowledged append in the member's log; then either the next
    log object (a flush never acknowledged) or the segment a rewrite was writing is
    found torn. The restart keeps exactly what was acknowledged, and appends go on."""
    server = start_server()
    url = server.stream_url(unique_stream)
    create_stream(url, BYTES_TYPE)
    acknowledged = b""
    for number in range(5):
        body = record_bytes(0, number)
        response = requests.post(
            url,
            data=body,
            headers={"Content-Type": BYTES_TYPE, **CLOSE_CONNECTION},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        assert response.status_code == 204, response.text
        acknowledged += body
    tail = response.headers[NEXT_OFFSET]
    server.kill9()

    if where != "rewrite":
        tear_next_log_object(
            server, unique_stream, parse_position(tail), how, shaped=where == "shaped log"
        )
    else:
        tear_first_rewrite(server, acknowledged, how)
    server.start()
    head = requests.head(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
    assert head.status_code == 200, f"HEAD answered {head.status_code} {head.text}"
    assert head.headers[NEXT_OFFSET] == tail, "the torn, never-acknowledged tail was kept"
    assert read_bytes(url) == acknowledged
    appended = requests.post(
        url,
        data=record_bytes(1, 0),
        headers={"Content-Type": BYTES_TYPE, **CLOSE_CONNECTION},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert appended.status_code == 204, f"append answered {appended.status_code} {appended.text}"
    assert read_bytes(url) == acknowledged + record_bytes(1, 0)
