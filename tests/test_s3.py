"""PicoMQ on S3 (moto_server) through real gunicorn servers.

- Several nodes on one bucket: every acknowledged append lands exactly once, in each
  writer's order, and every node reads the same bytes.
- A long-poll reader on one node sees an append made through another (the delay is
  printed; its design bound is PICOMQ_POLL_INTERVAL, 1 s on S3).
- Storage outages and faults, through `faultproxy.FaultProxy` in front of a moto_server
  of the test's own: writes answer 503 with Retry-After and a JSON body, never a 2xx;
  the server recovers by itself; nothing acknowledged is lost or duplicated, also when
  S3 performed a create-only PUT but its answer was lost (500 or a dropped connection
  after the write, so the client's retry hears 412). A moto_server restarted empty
  checks that the server then believes storage, not its cache.
- Request costs, counted by the proxy: group commit batches concurrent appends into few
  PUTs, concurrent first requests to a node share one load of the stream, a writer
  that lost the race catches up with a listing however far behind it was, and idle
  streams cost no requests at all.

Figures are printed (run with `-s` to see them); only properties of the design are
asserted, never speeds.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import orjson
import pytest
import requests
from conftest import ManagedProcess, commit_put_records, create_bucket, s3_environment
from faultproxy import FaultProxy, Record

from directory import REFRESH_SECONDS
from members import partition_of

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from conftest import ProxiedS3, S3Storage, Server, StartServer

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain"
BUSY_RETRIES = 20
S3_LIKE_LATENCY_MS = 30
LEASE_SECONDS = 3.0  # short, so a test waits out a lease quickly
REQUEST_TIMEOUT_SECONDS = 30.0
# Writers retry an append that was not acknowledged until this long after they started.
WRITER_DEADLINE_SECONDS = 40.0
RETRY_PAUSE_SECONDS = 0.05

NODES = 3
WORKERS_PER_NODE = 2
WRITERS_PER_NODE = 8
APPENDS_PER_WRITER = 12

LIVE_SAMPLES = 8
LIVE_LONG_POLL_TIMEOUT = 5.0  # far above the 1 s poll interval: a missed append fails
# The reader waits a varying while before each append, so the appends fall at different
# points of the reader's poll cycle and the delays show its spread.
LIVE_SETTLE_SECONDS = (0.2, 1.2)

FAULT_WRITERS = 8
FAULT_APPENDS_PER_WRITER = 6
OUTAGE_WRITES = 4
RECOVERY_DEADLINE_SECONDS = 30.0

PRODUCERS = 64
PRODUCER_MESSAGES = 5000
FIRST_REQUESTS = 16

IDLE_STREAMS = 100
IDLE_SETTLE_SECONDS = 1.5
IDLE_WINDOW_SECONDS = 3.0
LONG_POLL_WINDOW_SECONDS = 6.0
LONG_POLL_TIMEOUT = 2.0
INCARNATION = re.compile(r"[0-9a-f]{16}")


# -- HTTP helpers -----------------------------------------------------------------------------


def parse_offset(text: str) -> int:
    return int(text.split("_")[1])


def create_stream(
    node: Server, path: str, content_type: str = JSON_TYPE, body: bytes = b""
) -> None:
    response = requests.put(
        node.stream_url(path),
        data=body,
        headers={"Content-Type": content_type},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert response.status_code == 201, response.text


def read_stream(node: Server, path: str) -> bytes:
    """Every byte of a stream through `node`, over as many catch-up reads as it takes.

    JSON pages are joined into one array, as if the stream had been read at once.
    """
    pages, offset = [], "-1"
    while True:
        response = requests.get(
            node.stream_url(path), params={"offset": offset}, timeout=REQUEST_TIMEOUT_SECONDS
        )
        assert response.status_code == 200, response.text
        pages.append(response.content)
        offset = response.headers[NEXT_OFFSET]
        if response.headers.get(UP_TO_DATE) == "true":
            break
    if not response.headers["Content-Type"].startswith(JSON_TYPE):
        return b"".join(pages)
    return b"[" + b",".join(page[1:-1] for page in pages if page != b"[]") + b"]"


def describe_disagreement(contents: list[bytes]) -> str:
    """Which node holds what, and where the first two that differ part ways."""
    counts = [len(orjson.loads(content)) for content in contents]
    first, other = contents[0], next(content for content in contents if content != contents[0])
    parted = next(
        (at for at, (a, b) in enumerate(zip(first, other, strict=False)) if a != b),
        min(len(first), len(other)),
    )
    return (
        f"nodes disagree: {counts} messages, {[len(content) for content in contents]} bytes;"
        f" the first differing pair parts at byte {parted}"
    )


def format_offset(position: int) -> str:
    return f"{0:016d}_{position:016d}"


def stored_messages(data: bytes) -> list[tuple[dict, int]]:
    """Each message of a JSON stream with the offset just past it (messages end with ',')."""
    messages, position = [], 0
    for message in orjson.loads(data):
        position += len(orjson.dumps(message)) + 1
        messages.append((message, position))
    return messages


def assert_unavailable(response: requests.Response) -> None:
    """A storage failure is a 503 with Retry-After and a JSON error body, nothing else."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers.get("Retry-After"), response.headers
    assert response.headers.get("Content-Type", "").startswith(JSON_TYPE)
    assert "error" in response.json()


# -- writers that record exactly what was acknowledged ---------------------------------------


@dataclass
class WriterLog:
    name: str
    acked: dict[tuple[int, int], int | None] = field(default_factory=dict)  # (n, try): offset
    attempts: set[tuple[int, int]] = field(default_factory=set)
    failures: Counter[str] = field(default_factory=Counter)


def run_writer(
    urls: list[str], name: str, count: int, *, producer: bool, close_connections: bool = True
) -> WriterLog:
    """Append `count` messages one after another, each until acknowledged.

    A plain append that failed is retried as a new message (`try` + 1): the first may or
    may not have landed, and the check allows it at most once. An idempotent producer
    retries the same Producer-Seq with the same body, which the server deduplicates.
    Only 503 (or a dropped connection) may answer an append that was not acknowledged.
    """
    log = WriterLog(name)
    session = requests.Session()
    deadline = time.monotonic() + WRITER_DEADLINE_SECONDS
    for n in range(count):
        attempt = 0
        while True:
            assert time.monotonic() < deadline, f"{name}: append {n} never acknowledged"
            message = {"w": name, "n": n, "t": 0 if producer else attempt}
            headers = {"Content-Type": JSON_TYPE}
            if close_connections:
                headers["Connection"] = "close"  # spread requests over the workers
            if producer:
                headers.update({"Producer-Id": name, "Producer-Epoch": "0", "Producer-Seq": str(n)})
            key = (n, message["t"])
            log.attempts.add(key)
            try:
                response = session.post(
                    urls[(n + attempt) % len(urls)],
                    data=orjson.dumps(message),
                    headers=headers,
                    timeout=REQUEST_TIMEOUT_SECONDS,
                )
            except requests.ConnectionError:
                log.failures["connection"] += 1
                attempt += 1
                continue
            if response.ok:
                offset = response.headers.get(NEXT_OFFSET)
                log.acked[key] = parse_offset(offset) if offset else None
                break
            assert_unavailable(response)
            log.failures[str(response.status_code)] += 1
            attempt += 1
            time.sleep(RETRY_PAUSE_SECONDS)
    return log


def run_writers(
    urls_of_writer: list[list[str]],
    count: int,
    *,
    prefix: str = "writer",
    close_connections: bool = True,
) -> list[WriterLog]:
    """One thread per writer; even-numbered writers are idempotent producers."""
    with ThreadPoolExecutor(len(urls_of_writer)) as pool:
        futures = [
            pool.submit(
                run_writer,
                urls,
                f"{prefix}-{number}",
                count,
                producer=number % 2 == 0,
                close_connections=close_connections,
            )
            for number, urls in enumerate(urls_of_writer)
        ]
        return [future.result() for future in futures]


def check_exactly_once(data: bytes, logs: list[WriterLog], count: int) -> None:
    """Acknowledged messages: once each, where the ack said, in each writer's order.

    A message whose append was never acknowledged may be there at most once.
    """
    stored = stored_messages(data)
    seen = Counter((message["w"], message["n"], message["t"]) for message, _ in stored)
    attempted = {(log.name, *key) for log in logs for key in log.attempts}
    assert set(seen) <= attempted, f"stored messages nobody sent: {set(seen) - attempted}"
    repeated = {key: times for key, times in seen.items() if times > 1}
    assert not repeated, f"messages stored more than once: {repeated}"
    ends = {(message["w"], message["n"], message["t"]): end for message, end in stored}
    for log in logs:
        assert len(log.acked) == count
        for (n, attempt), offset in log.acked.items():
            key = (log.name, n, attempt)
            assert seen[key] == 1, f"acknowledged message {key} is missing"
            if offset is not None:
                assert ends[key] == offset, f"{key} acknowledged at {offset}, stored at {ends[key]}"
        order = [
            message["n"]
            for message, _ in stored
            if message["w"] == log.name and (message["n"], message["t"]) in log.acked
        ]
        assert order == list(range(count)), f"{log.name} out of order: {order}"


def unacknowledged_stored(data: bytes, logs: list[WriterLog]) -> int:
    acked = {(log.name, *key) for log in logs for key in log.acked}
    return sum(
        (message["w"], message["n"], message["t"]) not in acked
        for message, _ in stored_messages(data)
    )


def spread(urls: list[str], writers_per_url: int) -> list[list[str]]:
    """Writers for each URL: each writer sends every append to its own node."""
    return [[url] for url in urls for _ in range(writers_per_url)]


# -- (a) several nodes on one bucket -------------------------------------------------------------


def test_nodes_on_one_bucket_keep_every_acknowledged_append(
    s3_storage: S3Storage, start_server: StartServer, unique_stream: str, tmp_path: Path
) -> None:
    """Each node's workers take turns at a stream's commits; the nodes, as on machines of
    their own (a temporary directory each, where the writer locks live), do not."""
    nodes = []
    for number in range(NODES):
        machine_tmp = tmp_path / f"node{number}"
        machine_tmp.mkdir()
        env = {**s3_storage.env, "TMPDIR": str(machine_tmp)}
        nodes.append(start_server(storage_url=s3_storage.url, env=env, workers=WORKERS_PER_NODE))
    create_stream(nodes[0], unique_stream)

    started = time.monotonic()
    urls = [node.stream_url(unique_stream) for node in nodes]
    logs = run_writers(spread(urls, WRITERS_PER_NODE), APPENDS_PER_WRITER)
    elapsed = time.monotonic() - started

    contents = [read_stream(node, unique_stream) for node in nodes]
    assert all(content == contents[0] for content in contents), describe_disagreement(contents)
    check_exactly_once(contents[0], logs, APPENDS_PER_WRITER)
    appends = len(logs) * APPENDS_PER_WRITER
    failures = sum((log.failures for log in logs), Counter())
    print(
        f"\n{NODES} nodes x {WORKERS_PER_NODE} workers, {len(logs)} writers: {appends} appends"
        f" in {elapsed:.1f} s ({appends / elapsed:.0f}/s); retried failures {dict(failures)}"
    )


# -- (b) live reads across nodes ------------------------------------------------------------------


def test_long_poll_on_one_node_sees_an_append_through_another(
    s3_storage: S3Storage, start_server: StartServer, unique_stream: str
) -> None:
    reader_node, writer_node = (
        start_server(
            storage_url=s3_storage.url,
            env=s3_storage.env,
            workers=WORKERS_PER_NODE,
            long_poll_timeout=LIVE_LONG_POLL_TIMEOUT,
        )
        for _ in range(2)
    )
    create_stream(reader_node, unique_stream, TEXT_TYPE)
    offset, delays, settle = "-1", [], random.Random(7)
    for sample in range(LIVE_SAMPLES):
        if offset == "-1":
            offset = requests.head(reader_node.stream_url(unique_stream), timeout=10).headers[
                NEXT_OFFSET
            ]
        answer: dict[str, object] = {}

        def long_poll(at: str = offset, answer: dict[str, object] = answer) -> None:
            response = requests.get(
                reader_node.stream_url(unique_stream),
                params={"offset": at, "live": "long-poll"},
                timeout=LIVE_LONG_POLL_TIMEOUT + REQUEST_TIMEOUT_SECONDS,
            )
            answer.update(response=response, at=time.monotonic())

        reader = threading.Thread(target=long_poll)
        reader.start()
        time.sleep(settle.uniform(*LIVE_SETTLE_SECONDS))  # the reader waits before the append
        body = f"sample-{sample};".encode()
        appended = requests.post(
            writer_node.stream_url(unique_stream),
            data=body,
            headers={"Content-Type": TEXT_TYPE},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        acknowledged_at = time.monotonic()
        assert appended.status_code == 204, appended.text
        reader.join()
        response = answer["response"]
        assert isinstance(response, requests.Response)
        assert response.status_code == 200, "the long-poll ended without the other node's append"
        assert response.content == body
        delays.append(answer["at"] - acknowledged_at)  # type: ignore[operator]
        offset = response.headers[NEXT_OFFSET]

    delays.sort()
    print(
        f"\ncross-node long-poll delay after the append's ack, {len(delays)} samples (s):"
        f" min {delays[0]:.3f}, median {statistics.median(delays):.3f},"
        f" max {delays[-1]:.3f}; all: {[round(delay, 3) for delay in delays]}"
        " (design bound: PICOMQ_POLL_INTERVAL, 1 s on S3)"
    )


def test_a_source_erased_with_its_last_fork_on_another_node_is_gone_on_both(
    s3_storage: S3Storage, start_server: StartServer, unique_stream: str
) -> None:
    """The node serving a soft-deleted source answers from what it holds; when the
    source's last fork is deleted on another node, which erases the source, that node
    tells it, so neither answers 410 for a stream that is no longer there."""
    source_node, fork_node = (
        start_server(storage_url=s3_storage.url, env=s3_storage.env, workers=1) for _ in range(2)
    )
    fork = next(
        f"{unique_stream}-fork{n}"
        for n in range(100)
        if partition_of(f"{unique_stream}-fork{n}") != partition_of(unique_stream)
    )
    create_stream(source_node, unique_stream, body=b'{"n":0}')  # its member serves it
    response = requests.put(
        fork_node.stream_url(fork),
        headers={"Stream-Forked-From": unique_stream},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert response.status_code == 201, response.text
    assert requests.delete(source_node.stream_url(unique_stream), timeout=10).status_code == 204
    assert requests.get(source_node.stream_url(unique_stream), timeout=10).status_code == 410
    assert requests.delete(fork_node.stream_url(fork), timeout=10).status_code == 204
    for node in (source_node, fork_node):
        assert requests.get(node.stream_url(unique_stream), timeout=10).status_code == 404


# -- (c) storage outages ------------------------------------------------------------------------


def post_json(url: str, value: object, **headers: str) -> requests.Response:
    return requests.post(
        url,
        data=orjson.dumps(value),
        headers={"Content-Type": JSON_TYPE, **headers},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )


def wait_for_recovery(url: str, make_value: Callable[[int], object]) -> tuple[float, int]:
    """Append until one is acknowledged; returns (seconds it took, failed tries)."""
    started, tries = time.monotonic(), 0
    while time.monotonic() - started < RECOVERY_DEADLINE_SECONDS:
        response = post_json(url, make_value(tries))
        if response.ok:
            return time.monotonic() - started, tries
        assert_unavailable(response)
        tries += 1
        time.sleep(0.2)
    pytest.fail(f"no append acknowledged within {RECOVERY_DEADLINE_SECONDS} s of S3 returning")


def test_storage_outage_answers_503_and_the_server_recovers(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """S3 unreachable (the proxy refuses connections), then back with all its data.

    This is the honest outage: S3 keeps its objects while clients cannot reach it, so
    the test can demand that nothing acknowledged before, during or after is lost.
    """
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    url = node.stream_url(unique_stream)
    create_stream(node, unique_stream)
    before = [{"phase": "before", "n": n} for n in range(5)]
    for value in before:
        assert post_json(url, value).status_code == 204
    known = read_stream(node, unique_stream)
    tail = stored_messages(known)[-1][1]

    proxied_s3.proxy.go_down()
    started = time.monotonic()
    with ThreadPoolExecutor(OUTAGE_WRITES) as pool:
        outage_answers = list(
            pool.map(lambda n: post_json(url, {"phase": "outage", "n": n}), range(OUTAGE_WRITES))
        )
    write_seconds = time.monotonic() - started
    for response in outage_answers:
        assert_unavailable(response)
    created = requests.put(
        node.stream_url(unique_stream + "-new"),
        headers={"Content-Type": JSON_TYPE},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert_unavailable(created)
    reads = {}
    for name, params in {
        "catch-up from the start": {"offset": "-1"},
        "long-poll at the tail": {"offset": format_offset(tail), "live": "long-poll"},
    }.items():
        response = requests.get(url, params=params, timeout=REQUEST_TIMEOUT_SECONDS)
        if response.status_code == 200 and "live" not in params:
            assert response.content == known, "a read during the outage returned wrong data"
        elif response.status_code not in (200, 204):
            assert_unavailable(response)
        reads[name] = response.status_code
    head = requests.head(url, timeout=REQUEST_TIMEOUT_SECONDS)
    reads["HEAD"] = head.status_code
    assert head.status_code in (200, 503)

    proxied_s3.proxy.come_up()
    recovery_seconds, failed_tries = wait_for_recovery(url, lambda n: {"phase": "after", "n": n})
    after = read_stream(node, unique_stream)
    stored = [message for message, _ in stored_messages(after)]
    assert stored[: len(before)] == before
    assert [m for m in stored if m["phase"] == "after"][-1]["n"] == failed_tries
    outage_stored = [m for m in stored if m["phase"] == "outage"]
    assert len(outage_stored) == len({m["n"] for m in outage_stored})
    assert "Traceback" not in node.output(), node.output()[-3000:]
    print(
        f"\noutage: {OUTAGE_WRITES} concurrent appends all 503 after {write_seconds:.1f} s;"
        f" reads during the outage: {reads}; recovered {recovery_seconds:.1f} s after S3"
        f" returned ({failed_tries} tries answered 503); outage appends stored anyway:"
        f" {len(outage_stored)}"
    )


def test_moto_restarted_empty_the_server_follows_storage(
    start_moto: Callable[[], ManagedProcess], start_server: StartServer, unique_stream: str
) -> None:
    """moto_server stopped, then started again on its port: it comes back empty.

    Real S3 never loses a bucket in an outage, so this cannot check that data survives
    (the proxied test above does). It checks the rest: 503s while moto is gone, and
    afterwards a server that believes storage, not its cache: the vanished stream is
    404, and new streams work, without restarting PicoMQ.
    """
    moto = start_moto()
    endpoint = f"http://127.0.0.1:{moto.port}"
    bucket = create_bucket(endpoint)
    env = {**s3_environment(endpoint), "PICOMQ_LEASE_SECONDS": str(LEASE_SECONDS)}
    node = start_server(storage_url=f"s3://{bucket}/picomq", env=env)
    url = node.stream_url(unique_stream)
    create_stream(node, unique_stream)
    assert post_json(url, {"n": 0}).status_code == 204

    moto.kill9()
    assert_unavailable(post_json(url, {"n": 1}))
    known = requests.get(url, params={"offset": "-1"}, timeout=REQUEST_TIMEOUT_SECONDS)
    if known.status_code != 200:  # served from the node's cache, or unavailable
        assert_unavailable(known)
    assert known.status_code != 200 or known.content == b'[{"n":0}]'

    moto.start()  # same port, no buckets
    requests.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
    # The node serves the stream alone, from what it holds, until its next look at its
    # claims (every third of the lease) finds them gone with the rest.
    deadline = time.monotonic() + 2 * LEASE_SECONDS
    while (gone := requests.get(url, params={"offset": "-1"}, timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "the node still serves its cache"
        time.sleep(0.2)
    assert gone.status_code == 404, (gone.status_code, gone.text)
    assert post_json(url, {"n": 2}).status_code == 404
    create_stream(node, unique_stream)
    assert post_json(url, {"n": 3}).status_code == 204
    assert read_stream(node, unique_stream) == b'[{"n":3}]'


# -- (d) injected faults -----------------------------------------------------------------------


def test_acknowledged_appends_survive_failed_and_dropped_requests(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """S3 answers 500/503 or drops the connection before the request reaches it."""
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=2)
    create_stream(node, unique_stream)
    proxy = proxied_s3.proxy
    proxy.set_faults(fail_fraction=0.2, fail_status=503, drop_fraction=0.05)
    urls = [node.stream_url(unique_stream)]
    half = FAULT_WRITERS // 2
    logs = run_writers([urls] * half, FAULT_APPENDS_PER_WRITER, prefix="with-503s")
    proxy.set_faults(fail_status=500)
    logs += run_writers([urls] * half, FAULT_APPENDS_PER_WRITER, prefix="with-500s")
    injected = proxy.injected()
    proxy.heal()

    data = read_stream(node, unique_stream)
    check_exactly_once(data, logs, FAULT_APPENDS_PER_WRITER)
    failures = sum((log.failures for log in logs), Counter())
    print(
        f"\nfaults before forwarding: injected {dict(injected)}; appends answered"
        f" {dict(failures)} before succeeding; unacknowledged messages stored:"
        f" {unacknowledged_stored(data, logs)}"
    )
    assert sum(injected.values()) > 0


def test_acknowledged_appends_survive_ambiguous_put_failures(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """The PUT of a segment reaches S3 and succeeds, but PicoMQ hears 500 or nothing.

    S3 clients retry; the retry of a create-only PUT then finds the object there (412).
    The segment is PicoMQ's own: an acknowledged append must still be stored once.
    """
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    create_stream(node, unique_stream)
    proxy = proxied_s3.proxy
    proxy.set_faults(
        fail_fraction=0.2,
        fail_status=500,
        drop_fraction=0.1,
        after_forward=True,
        methods=frozenset({"PUT"}),
    )
    urls = [node.stream_url(unique_stream)]
    logs = run_writers([urls] * FAULT_WRITERS, FAULT_APPENDS_PER_WRITER)
    injected = proxy.injected()
    proxy.heal()
    data = read_stream(node, unique_stream)
    failures = sum((log.failures for log in logs), Counter())
    print(
        f"\nfaults after forwarding PUTs: injected {dict(injected)}; appends answered"
        f" {dict(failures)} before succeeding"
    )
    check_exactly_once(data, logs, FAULT_APPENDS_PER_WRITER)


def test_a_rewrite_whose_answer_is_lost_is_not_taken_for_another_members(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """An append is held in the member's log; a fork has it rewritten into the stream's
    segment at once. S3 stores that segment, PicoMQ hears 500; what it finds there when
    it tries again is its own (the token says so), not a fence."""
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    create_stream(node, unique_stream)
    assert post_json(node.stream_url(unique_stream), {"n": 0}).ok
    proxied_s3.proxy.set_faults(
        fail_fraction=1.0,
        fail_status=500,
        after_forward=True,
        methods=frozenset({"PUT"}),
        path_contains="/seg/",
        limit=1,
    )
    fork = unique_stream + "-fork"
    headers = {"Stream-Forked-From": unique_stream}
    response = requests.put(node.stream_url(fork), headers=headers, timeout=10)
    if response.status_code == 503:  # the rewrite's outcome was unknown: the fork again
        response = requests.put(node.stream_url(fork), headers=headers, timeout=10)
    assert response.status_code == 201, response.text
    assert proxied_s3.proxy.injected() == Counter({"fail-500": 1})
    assert post_json(node.stream_url(unique_stream), {"n": 1}).ok  # still its member
    other = second_node(proxied_s3, start_server)
    assert read_stream(other, fork) == b'[{"n":0}]'
    assert read_stream(other, unique_stream) == b'[{"n":0},{"n":1}]'


def test_a_create_whose_answer_is_lost_keeps_its_initial_data(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """PUT with a body: S3 stores meta.json, PicoMQ hears 500, its retry hears 412."""
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    proxied_s3.proxy.set_faults(
        fail_fraction=1.0,
        fail_status=500,
        after_forward=True,
        methods=frozenset({"PUT"}),
        path_contains="meta.json",
        limit=1,
    )
    response = requests.put(
        node.stream_url(unique_stream),
        data=b'{"n":0}',
        headers={"Content-Type": JSON_TYPE},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert proxied_s3.proxy.injected() == Counter({"fail-500": 1})
    if not response.ok:
        assert_unavailable(response)
        return
    # Read through a node with an empty cache: storage is the only truth.
    stored = read_stream(second_node(proxied_s3, start_server), unique_stream)
    assert stored == b'[{"n":0}]', f"PUT answered {response.status_code}, storage holds {stored!r}"


def test_a_fork_whose_marker_answer_is_lost_is_created(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """PUT of a fork: S3 stores the source's fork marker, PicoMQ hears 500, then 412."""
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    create_stream(node, unique_stream, body=b'{"n":0}')
    proxied_s3.proxy.set_faults(
        fail_fraction=1.0,
        fail_status=500,
        after_forward=True,
        methods=frozenset({"PUT"}),
        path_contains="/forks/",
        limit=1,
    )
    fork = unique_stream + "-fork"
    response = requests.put(
        node.stream_url(fork),
        headers={"Stream-Forked-From": unique_stream},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert proxied_s3.proxy.injected() == Counter({"fail-500": 1})
    if not response.ok:
        assert_unavailable(response)
        return
    assert read_stream(second_node(proxied_s3, start_server), fork) == b'[{"n":0}]'


def second_node(proxied_s3: ProxiedS3, start_server: StartServer) -> Server:
    """Another PicoMQ on the same bucket: it knows only what storage holds."""
    return start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)


# -- (e) request costs -------------------------------------------------------------------------


def commit_puts(proxy: FaultProxy, since: int = 0) -> Counter[int]:
    """PUTs that hold appends, by status: 200 written, 412 lost a race."""
    return Counter(record.status for record in commit_put_records(proxy, since))


@pytest.mark.parametrize(("workers", "latency_ms"), [(1, 0), (2, 0), (1, S3_LIKE_LATENCY_MS)])
def test_group_commit_batches_concurrent_appends(
    workers: int,
    latency_ms: int,
    proxied_s3: ProxiedS3,
    start_server: StartServer,
    unique_stream: str,
) -> None:
    """64 producers on one stream: few PUTs of log objects, and every append answered.

    With two workers, the appends that reach the one not serving the stream are
    forwarded to the other: a forward costs no storage request (the owner's heartbeat
    is read once per lease, not once per request), and no append may wait past the
    request timeout.
    """
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=workers)
    create_stream(node, unique_stream)
    url = node.stream_url(unique_stream)
    proxied_s3.proxy.set_faults(delay_ms=latency_ms)  # moto answers in ~3 ms; S3 in tens
    since = proxied_s3.proxy.count()
    per_producer = PRODUCER_MESSAGES // PRODUCERS

    busy = Counter[str]()

    def produce(number: int) -> int:
        """A 503 (the other worker kept winning the race) means not stored: send again."""
        session = requests.Session()
        for n in range(per_producer):
            for _attempt in range(BUSY_RETRIES):
                try:
                    response = session.post(
                        url,
                        data=orjson.dumps({"p": number, "n": n}),
                        headers={"Content-Type": JSON_TYPE},
                        timeout=REQUEST_TIMEOUT_SECONDS,
                    )
                except requests.Timeout:
                    pytest.fail(f"an append waited over {REQUEST_TIMEOUT_SECONDS} s")
                if response.status_code != 503:
                    break
                assert response.headers.get("Retry-After"), "a 503 without Retry-After"
                busy["503"] += 1
            assert response.status_code == 204, response.text
        return per_producer

    started = time.monotonic()
    with ThreadPoolExecutor(PRODUCERS) as pool:
        sent = sum(pool.map(produce, range(PRODUCERS)))
    elapsed = time.monotonic() - started
    puts = commit_puts(proxied_s3.proxy, since)
    kinds = Counter(describe(record) for record in proxied_s3.proxy.log()[since:])

    stored = sorted(
        (message["p"], message["n"]) for message in orjson.loads(read_stream(node, unique_stream))
    )
    assert stored == [(p, n) for p in range(PRODUCERS) for n in range(per_producer)]
    written = puts[200]
    print(
        f"\n{workers} worker(s), {latency_ms} ms added per S3 request, {PRODUCERS} producers,"
        f" {sent} single-message appends"
        f" in {elapsed:.1f} s:"
        f" {written} log or segment PUTs written ({1000 * written / sent:.0f} per 1,000 messages,"
        f" {sent / written:.1f} messages per PUT), {puts[412]} lost a race (412),"
        f" {busy['503']} appends answered 503 and were sent again;"
        f" all S3 requests: {1000 * kinds.total() / sent:.0f} per 1,000 messages,"
        f" {dict(kinds.most_common())}"
    )
    assert sent / written > 1, "concurrent appends were not batched"
    heartbeat_reads = sum(
        record.method == "HEAD" and "/cluster/members/" in record.path
        for record in proxied_s3.proxy.log()[since:]
    )
    assert heartbeat_reads < sent / 100, f"{heartbeat_reads} reads of heartbeats"
    if latency_ms >= S3_LIKE_LATENCY_MS and workers == 1:
        # Without the linger the producers split into two cohorts taking turns (~32 each);
        # bench/compare.py --only s3-appends measures the figure with a faster client.
        assert sent / written > PRODUCERS / 2, "the producers' cohorts were not merged"


def test_a_create_does_not_read_back_what_it_wrote(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """The process that creates a stream, and serves it alone, knows all of it: the
    create costs its writes and the look for a stream already there, and the stream
    serves its first reads and appends from what the create built."""
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    first = f"{unique_stream}/first"
    create_stream(node, first)  # its partition is claimed, the directory read
    wait_until_quiet(proxied_s3.proxy)  # the directory is read after the create answers
    path = next(
        candidate
        for candidate in (f"{unique_stream}/{number}" for number in range(10_000))
        if partition_of(candidate) == partition_of(first)
    )
    since = proxied_s3.proxy.count()
    create_stream(node, path, body=b'{"n":0}')
    kinds = Counter(describe(record) for record in proxied_s3.proxy.log()[since:])
    read_back = {"GET meta.json", "GET seg", "HEAD gone", "LIST seg", "LIST pack", "LIST trim"}
    assert not read_back & set(kinds), kinds
    # meta.json looked for, the segment and meta.json written, meta.json's identity read;
    # a heartbeat may fall in too
    assert kinds.total() <= 5, kinds
    assert post_json(node.stream_url(path), {"n": 1}).status_code == 204
    assert orjson.loads(read_stream(node, path)) == [{"n": 0}, {"n": 1}]
    assert orjson.loads(read_stream(second_node(proxied_s3, start_server), path)) == [
        {"n": 0},
        {"n": 1},
    ]


def test_concurrent_first_requests_share_one_load_of_the_stream(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """Appends reaching a node that has not opened the stream yet: one handle, one writer.

    Loading a stream takes several S3 requests; requests arriving meanwhile must wait
    for that load, not start their own. Otherwise the node holds several handles of
    the stream, whose writers lose create-only races (412) to each other.
    """
    creator = second_node(proxied_s3, start_server)
    create_stream(creator, unique_stream)
    creator.stop()  # the stream's server is gone: the next one to be asked loads it
    node = start_server(storage_url=proxied_s3.url, env=proxied_s3.env, workers=1)
    proxied_s3.proxy.set_faults(delay_ms=S3_LIKE_LATENCY_MS)  # loading spans the burst
    since = proxied_s3.proxy.count()

    def append(number: int) -> int:
        return post_json(node.stream_url(unique_stream), {"n": number}).status_code

    with ThreadPoolExecutor(FIRST_REQUESTS) as pool:
        statuses = Counter(pool.map(append, range(FIRST_REQUESTS)))
    kinds = Counter(describe(record) for record in proxied_s3.proxy.log()[since:])
    assert statuses == {204: FIRST_REQUESTS}
    assert kinds["GET meta.json"] == 1, kinds
    assert commit_puts(proxied_s3.proxy, since)[412] == 0, kinds
    stored = orjson.loads(read_stream(node, unique_stream))
    assert sorted(message["n"] for message in stored) == list(range(FIRST_REQUESTS))


def test_idle_streams_cost_no_storage_requests(
    proxied_s3: ProxiedS3, start_server: StartServer, unique_stream: str
) -> None:
    """Nothing is asked of storage for streams nobody uses, nor, once its lease is over,
    for the node (heartbeats go only while it is asked to serve, or holds live reads)."""
    proxy = proxied_s3.proxy
    node = start_server(
        storage_url=proxied_s3.url,
        env={**proxied_s3.env, "PICOMQ_LEASE_SECONDS": str(LEASE_SECONDS)},
        workers=2,
        long_poll_timeout=LONG_POLL_TIMEOUT,
    )
    paths = [f"{unique_stream}/{number}" for number in range(IDLE_STREAMS)]
    started_creates, before_creates = time.monotonic(), proxy.count()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda path: create_stream(node, path, body=b'{"x":1}'), paths))
    creating = time.monotonic() - started_creates
    create_requests = proxy.log()[before_creates:]

    time.sleep(LEASE_SECONDS + IDLE_SETTLE_SECONDS)
    idle = idle_requests(proxy)
    assert not idle, f"{IDLE_STREAMS} idle streams cost requests: {idle}"

    # One long-poll reader, always waiting at the tail of one stream.
    stop = threading.Event()
    polls = Counter[int]()
    offset = requests.head(node.stream_url(paths[0]), timeout=10).headers[NEXT_OFFSET]

    def read_live() -> None:
        session = requests.Session()
        while not stop.is_set():
            response = session.get(
                node.stream_url(paths[0]),
                params={"offset": offset, "live": "long-poll"},
                timeout=LONG_POLL_TIMEOUT + REQUEST_TIMEOUT_SECONDS,
            )
            polls[response.status_code] += 1

    since, started = proxy.count(), time.monotonic()
    reader = threading.Thread(target=read_live)
    reader.start()
    time.sleep(LONG_POLL_WINDOW_SECONDS)
    window = time.monotonic() - started
    live_log = proxy.log()[since:]
    stop.set()
    reader.join()
    assert set(polls) == {204}

    time.sleep(LEASE_SECONDS + IDLE_SETTLE_SECONDS)  # the last wait ends, then heartbeats
    # The subscriptions' directory is read once more REFRESH_SECONDS after its last read
    # (directory.py), which may be the creates' last commit: a leftover of the creates,
    # bounded, and not of the reader.
    created = started_creates + creating
    time.sleep(max(0.0, created + REFRESH_SECONDS + IDLE_SETTLE_SECONDS - time.monotonic()))
    idle_after = idle_requests(proxy)
    assert not idle_after, f"requests went on after the last reader left: {idle_after}"
    kinds = Counter(describe(record) for record in live_log)
    print(
        f"\nidle: {IDLE_STREAMS} streams (created with a first message in {creating:.1f} s,"
        f" {len(create_requests) / IDLE_STREAMS:.1f} S3 requests each:"
        f" {dict(Counter(describe(r) for r in create_requests))}),"
        f" {IDLE_WINDOW_SECONDS:.0f} s windows before and after"
        f" the reader: 0 requests; one long-poll reader (timeout {LONG_POLL_TIMEOUT} s,"
        f" {sum(polls.values())} polls): {len(live_log)} requests in {window:.1f} s ="
        f" {len(live_log) / window:.2f}/s: {dict(kinds)}"
    )


def idle_requests(proxy: FaultProxy) -> list[str]:
    """What reached S3 during one idle window."""
    since = proxy.count()
    time.sleep(IDLE_WINDOW_SECONDS)
    return [f"{record.method} {record.path}" for record in proxy.log()[since:]]


def wait_until_quiet(proxy: FaultProxy, quiet_seconds: float = 0.5) -> None:
    """Until no request has reached S3 for `quiet_seconds` (10 s at most): what a
    request started in the background has ended."""
    deadline = time.monotonic() + 10
    count = proxy.count()
    while time.monotonic() < deadline:
        time.sleep(quiet_seconds)
        if proxy.count() == count:
            return
        count = proxy.count()
    raise AssertionError("requests to S3 went on for 10 s")


def describe(record: Record) -> str:
    """A request as "METHOD kind": the kind of object, or the folder a listing looks in."""
    if record.method == "GET" and "prefix=" in record.query:
        folder = parse_qs(record.query).get("prefix", [""])[0].rstrip("/").rsplit("/", 1)[-1]
        return f"LIST {'<incarnation>' if INCARNATION.fullmatch(folder) else folder or '/'}"
    for kind in ("/seg/", "/pack/", "meta.json", "/gone", "/touched", "/forks/", "/trim/"):
        if kind in record.path:
            return f"{record.method} {kind.strip('/')}"
    return f"{record.method} other"
