"""Several gunicorn workers on one data directory: the storage alone keeps them consistent.

Every request here goes out on a new connection (`Connection: close`) so the kernel hands
the requests of one stream to different worker processes. gunicorn's access log records
which worker (PID) served each request; tests use it to prove the requests really were
spread over several workers, so a test cannot pass by accident on a single process.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shlex
import stat
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import requests
from conftest import NEEDS_INOTIFY, commit_put_records, follow_stream, whole_lines

if TYPE_CHECKING:
    from conftest import ProxiedS3, Server, StartServer
    from faultproxy import Record

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
FORKED_FROM = "Stream-Forked-From"
TEXT_TYPE = "text/plain"
JSON_TYPE = "application/json"
CLOSE_CONNECTION = {"Connection": "close"}

WORKERS = 4
WRITERS = 12
APPENDS_PER_WRITER = 40
PRODUCERS = 4
SEQS_PER_PRODUCER = 25
COPIES_PER_SEQ = 3
LIVE_READERS = 32
SSE_READERS = 4
LIVE_ROUNDS = 5
# Long enough that a reader the cross-worker poll never woke fails with a 204 rather than
# passing on a timeout; every reader that works answers long before.
LIVE_TIMEOUT_SECONDS = 10.0
SETTLE_SECONDS = 0.3
RACERS = 16
CREATE_RACE_ROUNDS = 8
RECREATE_ROUNDS = 5
CATCH_UP_ROUNDS = 60
RACING_WRITERS = 8
RACE_SECONDS = 0.3
DELETE_RACE_ROUNDS = 32
TURN_LATENCY_MS = 5  # added to each S3 request: time for a second PUT to start meanwhile
ERA_ROUNDS = 10
MIXED_CLIENTS = 16
MIXED_STREAMS = 4
MIXED_SECONDS = 10.0
FORK_PAIRS = 3
FORK_RACE_ROUNDS = 3
RECHECK_SECONDS = 1.0  # on S3 a worker trusts what it knows of a stream this long
REQUEST_TIMEOUT_SECONDS = 15.0
MAX_READS = 1000
ACCESS_LOG_FORMAT = "%(p)s %(m)s %(U)s %(q)s %(s)s"
READINESS_PATH = "/v1/stream/__readiness-probe"
WORKERS_READY_SECONDS = 30.0


# -- servers whose access log names the worker ---------------------------------------------


def start_logged_server(
    start_server: StartServer,
    tmp_path: Path,
    *,
    long_poll_timeout: float = 0.5,
    storage_url: str | None = None,
    env: dict[str, str] | None = None,
    workers: int = WORKERS,
) -> tuple[Server, Path]:
    """A PicoMQ with `workers` workers, all serving; its access log names the worker of each
    request (`<pid> METHOD path query status`), through gunicorn's own settings."""
    access_log = tmp_path / "access.log"
    gunicorn_args = (
        f"--access-logfile {shlex.quote(str(access_log))} "
        f"--access-logformat {shlex.quote(ACCESS_LOG_FORMAT)}"
    )
    server = start_server(
        workers=workers,
        long_poll_timeout=long_poll_timeout,
        storage_url=storage_url,
        env={"GUNICORN_CMD_ARGS": gunicorn_args, **(env or {})},
    )
    wait_for_every_worker(server, access_log, workers)
    return server, access_log


def wait_for_every_worker(server: Server, access_log: Path, workers: int) -> None:
    """Probe on new connections until each worker has answered one (they boot one by one)."""
    probe = f"{server.url}{READINESS_PATH}-workers"
    path = urlsplit(probe).path

    def get_probe(_: int) -> None:
        requests.get(probe, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)

    deadline = time.monotonic() + WORKERS_READY_SECONDS
    with ThreadPoolExecutor(2 * workers) as pool:
        while True:
            list(pool.map(get_probe, range(2 * workers)))
            answered = serving_workers(access_log, "GET", path) if access_log.exists() else {}
            if len(answered) == workers:
                return
            assert time.monotonic() < deadline, f"only workers {answered} answered"
            time.sleep(0.05)


@dataclass(frozen=True)
class LoggedRequest:
    pid: str
    method: str
    path: str
    query: str
    status: str


def logged_requests(access_log: Path) -> list[LoggedRequest]:
    return [LoggedRequest(*line.split(" ")) for line in whole_lines(access_log)]


def serving_workers(access_log: Path, method: str, path: str) -> Counter[str]:
    """How many `method` requests on `path` each worker PID answered."""
    return Counter(
        entry.pid
        for entry in logged_requests(access_log)
        if entry.method == method and entry.path == path
    )


def assert_spread(access_log: Path, method: str, path: str) -> None:
    workers = serving_workers(access_log, method, path)
    assert len(workers) >= 2, f"every {method} went to one worker ({workers}): nothing was tested"


# -- small HTTP helpers ------------------------------------------------------------------


def stream_path(server: Server, stream: str) -> str:
    return urlsplit(server.stream_url(stream)).path


def create_stream(url: str, content_type: str, body: bytes = b"") -> None:
    response = requests.put(
        url,
        data=body,
        headers={"Content-Type": content_type, **CLOSE_CONNECTION},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert response.status_code == 201, (response.status_code, response.text)


def append(
    url: str, body: bytes, content_type: str = TEXT_TYPE, **headers: str
) -> requests.Response:
    return requests.post(
        url,
        data=body,
        headers={"Content-Type": content_type, **CLOSE_CONNECTION, **headers},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )


def head_tail(url: str) -> str:
    response = requests.head(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
    assert response.status_code == 200, response.status_code
    return response.headers[NEXT_OFFSET]


def read_bodies_to_tail(url: str) -> list[bytes]:
    """The stream's bodies from the start up to the tail HEAD names now (HEAD asks storage).

    Follows Stream-Next-Offset on new connections until it reaches that tail, without
    trusting Stream-Up-To-Date (test_catch_up_read_sees_appends_made_on_other_workers
    checks that header on its own).
    """
    tail, bodies = head_tail(url), []
    for response in follow_stream(url, MAX_READS, REQUEST_TIMEOUT_SECONDS):
        bodies.append(response.content)
        if response.headers[NEXT_OFFSET] == tail:
            return bodies
    pytest.fail(f"{url} did not reach its tail {tail} in {MAX_READS} reads")


def read_to_tail(url: str) -> bytes:
    return b"".join(read_bodies_to_tail(url))


def read_json_to_tail(url: str) -> list[dict]:
    return [message for body in read_bodies_to_tail(url) for message in json.loads(body)]


def parse_position(offset: str) -> int:
    """PicoMQ's offsets end with the byte position in the stream (see storage.py)."""
    return int(offset.rsplit("_", 1)[1])


RECORD_LENGTH = len(b"00:000000\n")


def record_bytes(writer_id: int, number: int) -> bytes:
    return f"{writer_id:02d}:{number:06d}\n".encode()


def parse_records(data: bytes) -> list[tuple[int, int]]:
    assert len(data) % RECORD_LENGTH == 0, f"stream of {len(data)} bytes holds a torn record"
    return [
        tuple(int(part) for part in data[start : start + RECORD_LENGTH].decode().split(":"))
        for start in range(0, len(data), RECORD_LENGTH)
    ]


def run_together(count: int, task: Callable[[int], object]) -> list[object]:
    """Run task(0..count-1) in threads released at the same moment; return their results."""
    barrier = threading.Barrier(count)

    def released(index: int) -> object:
        barrier.wait(timeout=REQUEST_TIMEOUT_SECONDS)
        return task(index)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(released, range(count)))


# -- 5. concurrent writers and producers across workers ------------------------------------


def test_concurrent_writers_across_workers_lose_duplicate_and_reorder_nothing(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    server, access_log = start_logged_server(start_server, tmp_path)
    url = server.stream_url(unique_stream)
    create_stream(url, TEXT_TYPE)
    write_records_together(url)
    assert_spread(access_log, "POST", stream_path(server, unique_stream))
    # The writers took turns through a file only PicoMQ's user may open (streamlocks.py).
    lock = server.data_dir / ".writers.lock"
    assert stat.S_IMODE(os.stat(lock, follow_symlinks=False).st_mode) == 0o600
    assert not list(Path(server.env["TMPDIR"]).glob("*writers*"))
    listed = requests.get(f"{server.url}/v1/streams").json()["streams"]
    assert ".writers.lock" not in [stream["path"] for stream in listed]


def test_workers_take_turns_at_the_commits_of_a_stream(
    proxied_s3: ProxiedS3, start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Appends to one stream on S3 reach every worker, and the PUTs that hold them never
    overlap in one folder: one member serves the stream (the others forward to it) and
    flushes its log one object at a time.

    Before members, each commit held the stream's lock (streamlocks.py, still taken by
    processes that write a stream they do not serve alone): the worker that had just
    committed wrote again while another's PUT lost at the old tail, and a worker could
    lose for seconds, 503 after CONTENTION_LIMIT_SECONDS.
    """
    server, access_log = start_logged_server(
        start_server, tmp_path, storage_url=proxied_s3.url, env=proxied_s3.env
    )
    url = server.stream_url(unique_stream)
    create_stream(url, TEXT_TYPE)
    proxied_s3.proxy.set_faults(delay_ms=TURN_LATENCY_MS)
    since = proxied_s3.proxy.count()
    write_records_together(url)
    assert_spread(access_log, "POST", stream_path(server, unique_stream))
    puts = sorted(commit_put_records(proxied_s3.proxy, since), key=lambda record: record.began)
    assert puts, "no PUT held the appends"
    by_folder: dict[str, list[Record]] = {}  # a member's log, or a stream's segments
    for record in puts:
        by_folder.setdefault(record.path.rsplit("/", 1)[0], []).append(record)
    overlapping = [
        (one, later)
        for records in by_folder.values()
        for one, later in pairwise(records)
        if later.began < one.ended
    ]
    assert not overlapping, f"{len(overlapping)} of {len(puts)} PUTs overlapped another"
    private = Path(server.env["TMPDIR"]) / f"picomq-{os.geteuid()}"  # streamlocks.py
    assert stat.S_IMODE(os.stat(private, follow_symlinks=False).st_mode) == 0o700
    assert len(list(private.glob("writers-*.lock"))) == 1


def write_records_together(url: str) -> None:
    """WRITERS append APPENDS_PER_WRITER records each, at once, on new connections (so
    through every worker): none lost, duplicated or reordered, each at its offset."""

    def write(writer_id: int) -> dict[int, str]:
        acknowledged = {}
        for number in range(APPENDS_PER_WRITER):
            response = append(url, record_bytes(writer_id, number))
            assert response.status_code == 204, (response.status_code, response.text)
            acknowledged[number] = response.headers[NEXT_OFFSET]
        return acknowledged

    offsets = dict(enumerate(run_together(WRITERS, write)))
    data = read_to_tail(url)

    records = parse_records(data)
    assert len(records) == WRITERS * APPENDS_PER_WRITER, "lost or duplicated appends"
    assert len(set(records)) == len(records), "an append is stored twice"
    for writer_id in range(WRITERS):
        numbers = [number for writer, number in records if writer == writer_id]
        assert numbers == list(range(APPENDS_PER_WRITER)), f"writer {writer_id}: {numbers}"
    all_offsets = [offset for acknowledged in offsets.values() for offset in acknowledged.values()]
    assert len(set(all_offsets)) == len(all_offsets), "two appends were answered the same offset"
    for writer_id, acknowledged in offsets.items():
        for number, offset in acknowledged.items():
            end = parse_position(offset)
            assert data[end - RECORD_LENGTH : end] == record_bytes(writer_id, number), (
                f"writer {writer_id} message {number} is not at its acknowledged offset {offset}"
            )


def test_idempotent_producers_across_workers_store_each_seq_once(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Each seq goes out COPIES_PER_SEQ times at once on separate connections (a client
    retrying through different workers): exactly one copy is appended, the others are
    duplicates naming that seq, and every later retry is a duplicate too."""
    server, access_log = start_logged_server(start_server, tmp_path)
    url = server.stream_url(unique_stream)
    create_stream(url, JSON_TYPE)

    def send(producer_id: str, seq: int) -> requests.Response:
        body = json.dumps({"producer": producer_id, "seq": seq}).encode()
        headers = {"Producer-Id": producer_id, "Producer-Epoch": "0", "Producer-Seq": str(seq)}
        return append(url, body, JSON_TYPE, **headers)

    def produce(number: int) -> None:
        producer_id = f"producer-{number}"
        with ThreadPoolExecutor(COPIES_PER_SEQ) as copies:
            for seq in range(SEQS_PER_PRODUCER):
                copies_sent = [copies.submit(send, producer_id, seq) for _ in range(COPIES_PER_SEQ)]
                responses = [copy.result() for copy in copies_sent]
                statuses = sorted(response.status_code for response in responses)
                assert statuses == [200] + [204] * (COPIES_PER_SEQ - 1), (seq, statuses)
                assert {response.headers["Producer-Seq"] for response in responses} == {str(seq)}
                if seq > 0:
                    retry = send(producer_id, seq - 1)
                    assert retry.status_code == 204, (seq - 1, retry.status_code, retry.text)
                    assert retry.headers["Producer-Seq"] == str(seq)

    run_together(PRODUCERS, produce)

    messages = read_json_to_tail(url)
    for number in range(PRODUCERS):
        seqs = [
            message["seq"] for message in messages if message["producer"] == f"producer-{number}"
        ]
        assert seqs == list(range(SEQS_PER_PRODUCER)), f"producer-{number}: {seqs}"
    assert len(messages) == PRODUCERS * SEQS_PER_PRODUCER
    assert_spread(access_log, "POST", stream_path(server, unique_stream))


def test_catch_up_read_sees_appends_made_on_other_workers(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Read-your-writes across workers: once an append is acknowledged, a catch-up read from
    the start on any worker either includes it or does not claim Stream-Up-To-Date."""
    server, access_log = start_logged_server(start_server, tmp_path)
    url, path = server.stream_url(unique_stream), stream_path(server, unique_stream)
    create_stream(url, TEXT_TYPE)
    stale = []
    number = 0

    def more_to_read(rounds: int) -> bool:
        """CATCH_UP_ROUNDS, and up to 4 times as many while one worker took every read:
        with one connection at a time, the kernel may hand them all to the same worker."""
        if rounds < CATCH_UP_ROUNDS:
            return True
        return rounds < 4 * CATCH_UP_ROUNDS and len(serving_workers(access_log, "GET", path)) < 2

    while more_to_read(number):
        acknowledged = append(url, record_bytes(0, number))
        assert acknowledged.status_code == 204, acknowledged.text
        read = requests.get(
            url, params={"offset": "-1"}, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS
        )
        assert read.status_code == 200, read.text
        claims_tail = read.headers.get(UP_TO_DATE) == "true"
        if claims_tail and read.headers[NEXT_OFFSET] != acknowledged.headers[NEXT_OFFSET]:
            stale.append((number, acknowledged.headers[NEXT_OFFSET], read.headers[NEXT_OFFSET]))
        number += 1
    assert_spread(access_log, "GET", path)
    assert not stale, (
        f"{len(stale)} of {number} reads claimed Stream-Up-To-Date without an acknowledged append "
        f"(number, acknowledged tail, read's Next-Offset): {stale[:5]}"
    )


# -- 6. live reads wake up across workers ---------------------------------------------------


@dataclass
class Wakeup:
    reader: str
    status: int
    body: bytes
    next_offset: str | None
    woke_at: float


def connect(server: Server) -> http.client.HTTPConnection:
    parts = urlsplit(server.url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=LIVE_TIMEOUT_SECONDS + 5)


def long_poll(
    server: Server, path: str, offset: str, reader: str, sent: threading.Semaphore
) -> Wakeup:
    connection = connect(server)
    try:
        query = f"offset={offset}&live=long-poll&reader={reader}"
        connection.request("GET", f"{path}?{query}", headers=CLOSE_CONNECTION)
        sent.release()
        response = connection.getresponse()
        woke_at = time.monotonic()
        return Wakeup(
            reader, response.status, response.read(), response.getheader(NEXT_OFFSET), woke_at
        )
    finally:
        connection.close()


def read_sse_event(response: http.client.HTTPResponse) -> tuple[str, bytes]:
    event, data = "", []
    while True:
        line = response.readline()
        if not line:
            raise EOFError("SSE response ended")
        line = line.rstrip(b"\r\n")
        if not line:
            if event or data:
                return event, b"\n".join(data)
        elif line.startswith(b"event:"):
            event = line[len(b"event:") :].strip().decode()
        elif line.startswith(b"data:"):
            value = line[len(b"data:") :]
            data.append(value[1:] if value.startswith(b" ") else value)


def sse_read(
    server: Server, path: str, offset: str, reader: str, sent: threading.Semaphore
) -> Wakeup:
    """Wait at the tail (the first control event proves the server reached the tail)."""
    connection = connect(server)
    try:
        connection.request("GET", f"{path}?offset={offset}&live=sse&reader={reader}")
        response = connection.getresponse()
        assert response.status == 200, response.read()
        event, data = read_sse_event(response)
        assert event == "control" and json.loads(data).get("upToDate"), (event, data)
        sent.release()
        event, data = read_sse_event(response)
        woke_at = time.monotonic()
        assert event == "data", f"SSE reader {reader} got no data before its wait ended: {data}"
        control = json.loads(read_sse_event(response)[1])
        return Wakeup(reader, 200, data, control["streamNextOffset"], woke_at)
    finally:
        connection.close()


def wait_until_waiting(sent: threading.Semaphore, futures: list[Future[Wakeup]]) -> None:
    """Every reader sent its request; a reader that failed first surfaces its error."""
    for _ in futures:
        if not sent.acquire(timeout=REQUEST_TIMEOUT_SECONDS):
            for future in futures:
                if future.done():
                    future.result()
            pytest.fail("a live reader never got its request out")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def describe_delays(name: str, delays: list[float]) -> str:
    if not delays:
        return f"{name}: no samples"
    milliseconds = [delay * 1000 for delay in delays]
    return (
        f"{name}: n={len(delays)} p50={percentile(milliseconds, 0.5):.1f} ms "
        f"p99={percentile(milliseconds, 0.99):.1f} ms max={max(milliseconds):.1f} ms "
        f"mean={statistics.fmean(milliseconds):.1f} ms"
    )


@pytest.mark.parametrize(
    "poll_interval",
    ["auto", pytest.param("60", marks=NEEDS_INOTIFY)],
    ids=["auto", "watch only"],
)
def test_live_readers_on_every_worker_wake_on_one_append(
    start_server: StartServer, tmp_path: Path, unique_stream: str, poll_interval: str
) -> None:
    """Long-poll and SSE readers parked at the tail on various workers all get one append.

    Prints the delay from sending the append to each reader's wake-up (on
    local disk an inotify watch wakes readers on other workers; without one, the poll
    interval, 50 ms by default, bounds it); asserts only that every reader got the data
    before its deadline. With a minute between timed looks, only the watch can.
    """
    server, access_log = start_logged_server(
        start_server,
        tmp_path,
        long_poll_timeout=LIVE_TIMEOUT_SECONDS,
        env={
            "PICOMQ_SSE_MAX_DURATION": str(LIVE_TIMEOUT_SECONDS * 3),
            "PICOMQ_POLL_INTERVAL": poll_interval,
        },
    )
    url = server.stream_url(unique_stream)
    path = stream_path(server, unique_stream)
    create_stream(url, TEXT_TYPE)  # created empty: its segment directory is there to watch
    delays: dict[str, float] = {}
    for round_number in range(LIVE_ROUNDS):
        offset = head_tail(url)
        body = f"round {round_number}\n".encode()
        sent = threading.Semaphore(0)
        with ThreadPoolExecutor(LIVE_READERS + SSE_READERS) as pool:
            futures = [
                pool.submit(long_poll, server, path, offset, f"{round_number}-lp-{index}", sent)
                for index in range(LIVE_READERS)
            ] + [
                pool.submit(sse_read, server, path, offset, f"{round_number}-sse-{index}", sent)
                for index in range(SSE_READERS)
            ]
            wait_until_waiting(sent, futures)
            time.sleep(SETTLE_SECONDS)  # let the last long-poll requests reach their wait
            sent_at = time.monotonic()
            acknowledged = append(url, body)
            assert acknowledged.status_code == 204, acknowledged.text
            wakeups = [future.result() for future in futures]
        for wakeup in wakeups:
            assert (wakeup.status, wakeup.body) == (200, body), wakeup
            assert wakeup.next_offset == acknowledged.headers[NEXT_OFFSET], wakeup
            delays[wakeup.reader] = wakeup.woke_at - sent_at

    closed = append(url, b"", **{CLOSED: "true"})  # ends the SSE responses on the server
    assert closed.status_code == 204, closed.text
    report_wakeup_delays(access_log, path, delays)


def report_wakeup_delays(access_log: Path, path: str, delays: dict[str, float]) -> None:
    """Print delays split by whether the reader shared the appending worker; check the spread."""
    entries = [entry for entry in logged_requests(access_log) if entry.path == path]
    appenders = [entry.pid for entry in entries if entry.method == "POST"]
    reader_pids = {
        parameter.split("=", 1)[1]: entry.pid
        for entry in entries
        if entry.method == "GET"
        for parameter in entry.query.split("&")
        if parameter.startswith("reader=")
    }
    same, other = [], []
    for reader, delay in delays.items():
        if "-lp-" not in reader:
            continue
        round_number = int(reader.split("-", 1)[0])
        (same if reader_pids[reader] == appenders[round_number] else other).append(delay)
    sse = [delay for reader, delay in delays.items() if "-sse-" in reader]
    print()
    print(describe_delays("long-poll, all", same + other))
    print(describe_delays("long-poll, reader on the appending worker", same))
    print(describe_delays("long-poll, reader on another worker", other))
    print(describe_delays("sse, all", sse))
    print(f"long-poll readers per worker: {Counter(reader_pids.values())}")
    assert other, "no long-poll reader landed on another worker than the append: nothing tested"


# -- 7. create and delete races across workers -----------------------------------------------


def test_concurrent_creates_of_one_stream_answer_one_201(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    server, access_log = start_logged_server(start_server, tmp_path)
    body = b"initial\n"
    for round_number in range(CREATE_RACE_ROUNDS):
        stream = f"{unique_stream}-{round_number}"
        url = server.stream_url(stream)

        def create(_: int, url: str = url) -> int:
            response = requests.put(
                url,
                data=body,
                headers={"Content-Type": TEXT_TYPE, **CLOSE_CONNECTION},
                timeout=REQUEST_TIMEOUT_SECONDS,
            )
            return response.status_code

        statuses = Counter(run_together(RACERS, create))
        assert statuses == {201: 1, 200: RACERS - 1}, f"round {round_number}: {statuses}"
        assert read_to_tail(url) == body, "the initial data is not there exactly once"
        # The stream's key on disk is its path: letters, digits and '-' are not encoded.
        stream_directory = server.data_dir / "streams" / stream
        incarnations = [path for path in stream_directory.iterdir() if path.is_dir()]
        assert len(incarnations) == 1, f"losing creates left data behind: {incarnations}"
    spread = [
        serving_workers(access_log, "PUT", stream_path(server, f"{unique_stream}-{round_number}"))
        for round_number in range(CREATE_RACE_ROUNDS)
    ]
    assert any(len(workers) >= 2 for workers in spread), f"no race spanned workers: {spread}"


def warm_every_worker(url: str) -> None:
    """Have each worker open (and cache) the stream: many reads on new connections."""
    for _ in range(4 * WORKERS):
        response = requests.get(
            url, params={"offset": "-1"}, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS
        )
        assert response.status_code == 200, response.text


def test_delete_then_recreate_across_workers_serves_only_new_data(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Workers that cached the old stream must notice it was deleted and re-created."""
    server, access_log = start_logged_server(start_server, tmp_path)
    url = server.stream_url(unique_stream)
    create_stream(url, TEXT_TYPE, b"generation 0 initial\n")
    for generation in range(1, RECREATE_ROUNDS + 1):
        old = append(url, f"generation {generation - 1} appended\n".encode())
        assert old.status_code == 204, old.text
        warm_every_worker(url)
        deleted = requests.delete(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
        assert deleted.status_code == 204, deleted.text
        initial = f"generation {generation} initial\n".encode()
        create_stream(url, TEXT_TYPE, initial)

        reads = run_together(RACERS, lambda _: read_to_tail(url))
        assert set(reads) == {initial}, f"generation {generation}: {set(reads)}"
        lines = [f"generation {generation} writer {index}\n".encode() for index in range(RACERS)]
        statuses = run_together(
            RACERS, lambda index, lines=lines: append(url, lines[index]).status_code
        )
        assert set(statuses) == {204}, statuses
        data = read_to_tail(url)
        assert data.startswith(initial)
        assert sorted(data[len(initial) :].splitlines(keepends=True)) == sorted(lines)
    assert_spread(access_log, "POST", stream_path(server, unique_stream))


@dataclass
class TimedAppend:
    number: int
    sent_at: float
    answered_at: float
    status: int


@dataclass
class RacingWriter:
    writer_id: int
    appends: list[TimedAppend] = field(default_factory=list)

    def run(self, url: str, stop: threading.Event) -> None:
        number = 0
        while not stop.is_set():
            sent_at = time.monotonic()
            status = append(url, record_bytes(self.writer_id, number)).status_code
            self.appends.append(TimedAppend(number, sent_at, time.monotonic(), status))
            number += 1


def test_delete_and_recreate_racing_appends_keeps_eras_apart(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Appends keep coming while the stream is deleted and re-created, a few times over.

    An append answered before the DELETE was sent belongs to the old stream and must not
    show up in the new one; an append sent after the re-create was answered must be in the
    new one if it was acknowledged; appends in between may land in either, at most once.
    Every answer is a 204, or a 404 while no stream exists; the DELETE answers 204.
    """
    server, _ = start_logged_server(start_server, tmp_path)
    url = server.stream_url(unique_stream)
    create_stream(url, TEXT_TYPE)
    for generation in range(1, ERA_ROUNDS + 1):
        writers = [RacingWriter(writer_id) for writer_id in range(RACING_WRITERS)]
        stop = threading.Event()
        with ThreadPoolExecutor(len(writers)) as pool:
            futures = [pool.submit(writer.run, url, stop) for writer in writers]
            time.sleep(RACE_SECONDS)
            delete_sent_at = time.monotonic()
            deleted = requests.delete(
                url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS
            )
            initial = record_bytes(99, generation)
            create_stream(url, TEXT_TYPE, initial)
            recreated_at = time.monotonic()
            time.sleep(RACE_SECONDS)
            stop.set()
            for future in futures:
                future.result()
        check_eras(url, initial, writers, delete_sent_at, recreated_at)
        # After the data checks, so that a wrong answer to the DELETE does not hide them.
        assert deleted.status_code == 204, (generation, deleted.status_code, deleted.text)


def check_eras(
    url: str,
    initial: bytes,
    writers: list[RacingWriter],
    delete_sent_at: float,
    recreated_at: float,
) -> None:
    statuses = Counter(entry.status for writer in writers for entry in writer.appends)
    assert set(statuses) <= {204, 404}, f"appends racing a delete answered {statuses}"
    data = read_to_tail(url)
    assert data.startswith(initial), data[:100]
    stored = Counter(parse_records(data[len(initial) :]))
    assert all(count == 1 for count in stored.values()), "an append is stored twice"
    for writer in writers:
        for entry in writer.appends:
            record = (writer.writer_id, entry.number)
            if entry.answered_at < delete_sent_at:
                assert record not in stored, f"{record} from the deleted stream reappeared"
            elif entry.sent_at > recreated_at:
                assert entry.status == 204, f"{record} sent to the new stream: {entry.status}"
                assert record in stored, f"{record} acknowledged by the new stream is missing"
            elif entry.status != 204:
                assert record not in stored, f"{record} was refused but stored"


def test_concurrent_deletes_of_one_stream_answer_one_204(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Only one DELETE of a stream can succeed; the others find no stream (404)."""
    server, access_log = start_logged_server(start_server, tmp_path)
    spread = []
    for round_number in range(DELETE_RACE_ROUNDS):
        stream = f"{unique_stream}-{round_number}"
        url = server.stream_url(stream)
        create_stream(url, TEXT_TYPE, b"doomed\n")
        warm_every_worker(url)

        def delete(_: int, url: str = url) -> int:
            return requests.delete(
                url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS
            ).status_code

        statuses = Counter(run_together(RACERS, delete))
        assert statuses == {204: 1, 404: RACERS - 1}, f"round {round_number}: {statuses}"
        head = requests.head(url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
        assert head.status_code == 404
        spread.append(serving_workers(access_log, "DELETE", stream_path(server, stream)))
    assert any(len(workers) >= 2 for workers in spread), f"no race spanned workers: {spread}"


# What each request may answer while others close and delete its stream (a create or an
# append meets a closed stream: 409).
ANSWERS_AROUND_DELETES = {
    "create 200",
    "create 201",
    "create 409",
    "append 204",
    "append 404",
    "append 409",
    "close 204",
    "close 404",
    "read 200",
    "read 404",
    "read cut",
    "long-poll 200",
    "long-poll 204",
    "long-poll 404",
    "long-poll cut",
    "delete 204",
    "delete 404",
}


@dataclass(frozen=True)
class RacingRequest:
    """A kind of request the racing clients send, and how often relative to the others.

    It goes to the stream its `target` names; "{source}" in a header value stands for the
    name of the stream named "source". Every request also asks for Connection: close.
    """

    weight: int
    method: str
    query: str = ""
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    target: str = "stream"


JSON_HEADERS = {"Content-Type": JSON_TYPE}
MIXED_REQUESTS = {
    "create": RacingRequest(3, "PUT", body=b"[1]", headers=JSON_HEADERS),
    "append": RacingRequest(10, "POST", body=b"[2,3]", headers=JSON_HEADERS),
    "close": RacingRequest(1, "POST", headers={**JSON_HEADERS, CLOSED: "true"}),
    "read": RacingRequest(6, "GET", "?offset=-1"),
    "long-poll": RacingRequest(2, "GET", "?offset=now&live=long-poll"),
    "delete": RacingRequest(1, "DELETE"),
}


def mixed_request(
    session: requests.Session,
    server: Server,
    streams: dict[str, str],
    table: dict[str, RacingRequest],
    choose: random.Random,
) -> str:
    """One request of a random kind from `table` to one of `streams` (target: name):
    "<kind> <status>", or "<kind> cut"."""
    [kind] = choose.choices(list(table), [request.weight for request in table.values()])
    request = table[kind]
    headers = {name: value.format(**streams) for name, value in request.headers.items()}
    try:
        answer = session.request(
            request.method,
            server.stream_url(streams[request.target]) + request.query,
            data=request.body or None,
            headers={**CLOSE_CONNECTION, **headers},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
    except requests.exceptions.ChunkedEncodingError:
        return f"{kind} cut"  # a read spanning pieces, deleted while it was sent
    return f"{kind} {answer.status_code}"


def race_mixed_requests(
    server: Server, choices: list[dict[str, str]], table: dict[str, RacingRequest]
) -> Counter[str]:
    """MIXED_CLIENTS clients send requests from `table` for MIXED_SECONDS, each to streams
    chosen at random from `choices`; what they were answered, counted."""
    stop_at = time.monotonic() + MIXED_SECONDS

    def client(seed: int) -> Counter[str]:
        choose, answers = random.Random(seed), Counter[str]()
        with requests.Session() as session:
            while time.monotonic() < stop_at:
                streams = choose.choice(choices)
                answers[mixed_request(session, server, streams, table, choose)] += 1
        return answers

    return sum(run_together(MIXED_CLIENTS, client), Counter[str]())


def test_requests_racing_deletes_on_every_worker_never_answer_a_server_error(
    start_server: StartServer, tmp_path: Path, unique_stream: str
) -> None:
    """Creates, appends, reads and long-polls keep coming while other requests close and
    delete the same few streams, on every worker: each answers as if it came wholly before
    or after a close (a 409) or a DELETE (a 404, or a 201 for a create), never a 5xx."""
    server, _ = start_logged_server(start_server, tmp_path, long_poll_timeout=0.3)
    streams = [{"stream": f"{unique_stream}-{number}"} for number in range(MIXED_STREAMS)]
    answers = race_mixed_requests(server, streams, MIXED_REQUESTS)
    unexpected = {answer for answer in answers if answer not in ANSWERS_AROUND_DELETES}
    assert not unexpected, f"unexpected answers among {answers}"
    assert answers["delete 204"] and answers["read 200"] and answers["append 404"], answers


# What sources and forks may answer while both are created, used and deleted through every
# worker: a fork of a deleted source is refused (404 if it is gone, 409 while it is being
# deleted or is soft-deleted), and a soft-deleted source answers 410.
ANSWERS_AROUND_FORKS = {
    *(f"source create {status}" for status in (200, 201, 409)),
    *(f"source append {status}" for status in (204, 404, 410)),
    *(f"source read {status}" for status in (200, 404, 410, "cut")),
    *(f"source delete {status}" for status in (204, 404, 410)),
    *(f"fork create {status}" for status in (200, 201, 404, 409)),
    *(f"fork append {status}" for status in (204, 404)),
    *(f"fork read {status}" for status in (200, 404, "cut")),
    *(f"fork delete {status}" for status in (204, 404)),
}
FORK_REQUESTS = {
    "source create": RacingRequest(4, "PUT", body=b"[1]", headers=JSON_HEADERS, target="source"),
    "source append": RacingRequest(3, "POST", body=b"[2]", headers=JSON_HEADERS, target="source"),
    "source read": RacingRequest(2, "GET", "?offset=-1", target="source"),
    "source delete": RacingRequest(3, "DELETE", target="source"),
    "fork create": RacingRequest(6, "PUT", headers={FORKED_FROM: "{source}"}, target="fork"),
    "fork append": RacingRequest(2, "POST", body=b"[3]", headers=JSON_HEADERS, target="fork"),
    "fork read": RacingRequest(3, "GET", "?offset=-1", target="fork"),
    "fork delete": RacingRequest(2, "DELETE", target="fork"),
}


StartOnStorage = Callable[..., "Server"]


@pytest.fixture(params=["local", "s3"])
def start_on_each_storage(
    request: pytest.FixtureRequest, start_server: StartServer, tmp_path: Path
) -> StartOnStorage:
    """`start(env=None)`: start_logged_server on local disk, and in the second run on a
    fresh bucket of the session's moto_server."""

    def start(env: dict[str, str] | None = None) -> Server:
        storage_url = None
        if request.param == "s3":
            s3_storage = request.getfixturevalue("s3_storage")
            storage_url, env = s3_storage.url, {**s3_storage.env, **(env or {})}
        server, _ = start_logged_server(start_server, tmp_path, storage_url=storage_url, env=env)
        return server

    return start


def test_forks_racing_deletes_of_their_sources_on_every_worker_are_never_orphaned(
    start_on_each_storage: StartOnStorage, unique_stream: str
) -> None:
    """Forks are created, used and deleted while their sources are deleted and re-created,
    through every worker: no request answers a 5xx. Afterwards fresh processes, which know
    only what storage says, read every fork, and deleting it frees a soft-deleted source."""
    server = start_on_each_storage()
    pairs = [
        {"source": f"{unique_stream}-{number}", "fork": f"{unique_stream}-{number}-fork"}
        for number in range(FORK_PAIRS)
    ]
    # The race must have met the cases it is about; on a loaded machine one round of it
    # may miss one (a source read while soft-deleted, 410), so a few rounds are allowed.
    raced = ("fork create 201", "fork create 409", "source delete 204", "source read 410")
    answers = Counter[str]()
    for _ in range(FORK_RACE_ROUNDS):
        answers += race_mixed_requests(server, pairs, FORK_REQUESTS)
        if all(answers[case] for case in raced):
            break
    unexpected = {answer for answer in answers if answer not in ANSWERS_AROUND_FORKS}
    assert not unexpected, f"unexpected answers among {answers}"
    assert all(answers[case] for case in raced), answers

    server.restart()

    def status(method: str, stream: str) -> int:
        url = server.stream_url(stream)
        return requests.request(
            method, url, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS
        ).status_code

    forks_read = [status("GET", pair["fork"]) for pair in pairs]
    forks_deleted = [status("DELETE", pair["fork"]) for pair in pairs]
    time.sleep(RECHECK_SECONDS + SETTLE_SECONDS)
    sources_read = [status("GET", pair["source"]) for pair in pairs]
    assert set(forks_read) <= {200, 404}, forks_read
    assert set(forks_deleted) <= {204, 404}, forks_deleted
    assert set(sources_read) <= {200, 404}, sources_read  # none is kept for a fork now


# Every housekeeping job at work at once: retention (a few hundred bytes kept), compaction
# and re-listing of indexes every half second, TTLs that lapse, the sweep, forks of
# expiring streams, producers and closes, while streams are deleted and re-created.
HOUSEKEEPING_ENV = {
    "PICOMQ_RETENTION_BYTES": "400",
    "PICOMQ_INDEX_MAX_AGE": "0.5",
    "PICOMQ_SWEEP_INTERVAL": "2",
}
PRODUCER = {"Producer-Id": "racer", "Producer-Epoch": "0", "Producer-Seq": "0"}
HOUSEKEEPING_REQUESTS = {
    **FORK_REQUESTS,
    "source produce": RacingRequest(
        2, "POST", body=b"[9]", headers={**JSON_HEADERS, **PRODUCER}, target="source"
    ),
    "source close": RacingRequest(
        1, "POST", headers={**JSON_HEADERS, CLOSED: "true"}, target="source"
    ),
    "source long-poll": RacingRequest(2, "GET", "?offset=now&live=long-poll", target="source"),
    "expiring create": RacingRequest(
        2, "PUT", body=b"[1]", headers={**JSON_HEADERS, "Stream-TTL": "2"}, target="expiring"
    ),
    "expiring append": RacingRequest(
        3, "POST", body=b"[4]", headers=JSON_HEADERS, target="expiring"
    ),
    "expiring read": RacingRequest(2, "GET", "?offset=-1", target="expiring"),
    "expiring fork": RacingRequest(
        2, "PUT", headers={FORKED_FROM: "{expiring}"}, target="expiring-fork"
    ),
    "expiring-fork read": RacingRequest(2, "GET", "?offset=-1", target="expiring-fork"),
    "expiring-fork delete": RacingRequest(1, "DELETE", target="expiring-fork"),
}


def test_housekeeping_racing_requests_on_every_worker_never_answers_an_error(
    start_on_each_storage: StartOnStorage, unique_stream: str
) -> None:
    """Every request sent is well formed, so none may answer 400 or 5xx while retention,
    compaction, expiry and the sweep work on the streams through every worker."""
    server = start_on_each_storage(HOUSEKEEPING_ENV)
    roles = ("source", "fork", "expiring", "expiring-fork")
    streams = [
        {role: f"{unique_stream}-{number}-{role}" for role in roles} for number in range(FORK_PAIRS)
    ]
    answers = race_mixed_requests(server, streams, HOUSEKEEPING_REQUESTS)
    errors = {
        answer
        for answer in answers
        if answer.endswith(" 400") or answer.split()[-1].startswith("5")
    }
    assert not errors, f"errors among {answers}"
    assert answers["expiring fork 201"] and answers["source delete 204"], answers


# -- 8. what each worker makes on its own -----------------------------------------------------

REQUEST_ID_PROBES = 64


def test_request_ids_made_by_different_workers_never_repeat(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Workers are forked from one master: an id generator that each did not reseed would
    hand out the same ids in every worker. PicoMQ's own access lines carry the pid.
    A route that every worker serves itself: a stream's requests all go to its owner."""
    server, access_log = start_logged_server(start_server, tmp_path)
    probe = f"{server.url}/healthz"
    given: list[str] = []
    # As in the catch-up test: the kernel may hand a run of connections to one worker.
    while len(given) < REQUEST_ID_PROBES or (
        len(given) < 4 * REQUEST_ID_PROBES
        and len(serving_workers(access_log, "GET", urlsplit(probe).path)) < 2
    ):
        answer = requests.get(probe, headers=CLOSE_CONNECTION, timeout=REQUEST_TIMEOUT_SECONDS)
        given.append(answer.headers["X-Request-Id"])
    assert_spread(access_log, "GET", urlsplit(probe).path)
    deadline = time.monotonic() + REQUEST_TIMEOUT_SECONDS
    while len(logged := probe_lines(server, probe)) < len(given):
        assert time.monotonic() < deadline, f"{len(logged)} access lines of the probes"
        time.sleep(0.05)
    assert sorted(line["request_id"] for line in logged) == sorted(given)
    assert len({line["pid"] for line in logged}) >= 2
    assert len(set(given)) == len(given), f"repeated ids among {given}"


def probe_lines(server: Server, probe: str) -> list[dict]:
    """PicoMQ's JSON access lines of GETs on `probe`'s path, from the server's output."""
    path = urlsplit(probe).path
    lines = (line for line in server.output().splitlines() if line.startswith("{"))
    entries = (json.loads(line) for line in lines)
    return [entry for entry in entries if (entry.get("path"), entry.get("method")) == (path, "GET")]
