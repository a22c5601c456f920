"""Operations against real servers: health, readiness, the listing extension, metrics
summed across gunicorn workers, and JSON logs with a request id."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
import uuid
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import requests
from processes import free_port

from auth import mint_token

if TYPE_CHECKING:
    from conftest import Server, StartServer

JSON = "application/json"
DEADLINE_SECONDS = 20.0


def scrape(server: Server) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}."""
    response = requests.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for(condition, what: str) -> None:  # noqa: ANN001 - a zero-argument predicate
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def create(server: Server, path: str, content_type: str = JSON) -> None:
    response = requests.put(server.stream_url(path), headers={"Content-Type": content_type})
    assert response.status_code == 201, response.text


def access_log(server: Server) -> list[dict]:
    entries = []
    for line in server.output().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry["logger"] == "picomq.access":
                entries.append(entry)
    return entries


# -- health and readiness --------------------------------------------------------------


def test_healthz_and_readyz_answer_outside_the_stream_namespace(server: Server) -> None:
    for route, status in (("/healthz", "ok"), ("/readyz", "ready")):
        response = requests.get(f"{server.url}{route}", timeout=10)
        assert response.status_code == 200
        assert response.json() == {"status": status}
        assert response.headers["Cache-Control"] == "no-store"


def test_readyz_fails_while_the_data_directory_is_gone(start_server: StartServer) -> None:
    server = start_server()
    assert requests.get(f"{server.url}/readyz", timeout=10).status_code == 200
    shutil.rmtree(server.data_dir)
    try:
        response = requests.get(f"{server.url}/readyz", timeout=10)
        assert response.status_code == 503
        assert response.json()["status"] == "unavailable"
        assert requests.get(f"{server.url}/healthz", timeout=10).status_code == 200
    finally:
        server.data_dir.mkdir()
    assert requests.get(f"{server.url}/readyz", timeout=10).status_code == 200


def create_bucket(endpoint: str) -> str:
    bucket = f"ops-{uuid.uuid4().hex[:12]}"
    connection = http.client.HTTPConnection("127.0.0.1", urlsplit(endpoint).port, timeout=10)
    try:
        connection.request("PUT", f"/{bucket}")
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    return bucket


def s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }


def test_readyz_on_s3_follows_the_endpoint(start_server: StartServer, moto_s3: str) -> None:
    bucket = create_bucket(moto_s3)
    up = start_server(storage_url=f"s3://{bucket}/picomq", env=s3_env(moto_s3))
    assert requests.get(f"{up.url}/readyz", timeout=30).status_code == 200

    nothing_there = f"http://127.0.0.1:{free_port()}"
    down = start_server(storage_url=f"s3://{bucket}/picomq", env=s3_env(nothing_there))
    response = requests.get(f"{down.url}/readyz", timeout=60)
    assert response.status_code == 503
    assert requests.get(f"{down.url}/healthz", timeout=10).status_code == 200


# -- the listing extension ---------------------------------------------------------------


def list_all(server: Server, prefix: str, limit: int) -> tuple[list[dict], int]:
    """Every stream under prefix, following `next`; and how many pages it took."""
    streams, after, pages = [], None, 0
    while True:
        params = {"prefix": prefix, "limit": str(limit)}
        if after is not None:
            params["after"] = after
        response = requests.get(f"{server.url}/v1/streams", params=params, timeout=10)
        assert response.status_code == 200, response.text
        body = response.json()
        streams += body["streams"]
        pages += 1
        after = body["next"]
        if after is None:
            return streams, pages
        assert pages < 100, "listing never ends"


def test_listing_pages_through_a_prefix_in_path_order(server: Server, unique_stream: str) -> None:
    paths = [f"{unique_stream}/run-{n}" for n in (3, 1, 4, 5, 9)]
    for path in paths:
        create(server, path)
    requests.post(server.stream_url(paths[0]), data=b'[{"a":1}]', headers={"Content-Type": JSON})
    requests.post(server.stream_url(paths[1]), headers={"Stream-Closed": "true"})
    create(server, f"{unique_stream}-elsewhere", "text/plain")
    requests.delete(server.stream_url(paths[4]))

    streams, pages = list_all(server, f"{unique_stream}/", limit=2)

    assert [s["path"] for s in streams] == sorted(paths[:4])
    assert pages == 2
    by_path = {s["path"]: s for s in streams}
    assert by_path[paths[0]]["bytes"] == len(b'{"a":1},')
    assert by_path[paths[0]]["contentType"] == JSON
    assert by_path[paths[1]]["closed"] is True
    assert by_path[paths[2]] == {
        "path": paths[2],
        "contentType": JSON,
        "bytes": 0,
        "nextOffset": "0000000000000000_0000000000000000",
        "closed": False,
        "ttl": None,
        "expiresAt": None,
    }


def test_listing_shows_expiry_and_rejects_bad_parameters(
    server: Server, unique_stream: str
) -> None:
    response = requests.put(
        server.stream_url(unique_stream), headers={"Content-Type": JSON, "Stream-TTL": "3600"}
    )
    assert response.status_code == 201
    body = requests.get(f"{server.url}/v1/streams", params={"prefix": unique_stream}).json()
    assert [s["ttl"] for s in body["streams"]] == [3600]
    for params in ({"limit": "0"}, {"limit": "abc"}, {"limit": "1001"}, {"prefix": "x" * 2000}):
        response = requests.get(f"{server.url}/v1/streams", params=params, timeout=10)
        assert response.status_code == 400, params
        assert response.json()["error"]["code"] == "bad_request"


def test_a_stream_named_streams_is_still_a_stream(server: Server, unique_stream: str) -> None:
    path = f"{unique_stream}/streams"
    create(server, path)
    assert requests.head(server.stream_url(path), timeout=10).status_code == 200
    listed = requests.get(f"{server.url}/v1/streams", params={"prefix": path}).json()
    assert [s["path"] for s in listed["streams"]] == [path]


# -- metrics ---------------------------------------------------------------------------------


def append_on_new_connection(server: Server, path: str, body: bytes) -> None:
    with requests.Session() as session:  # a fresh connection: any worker may take it
        response = session.post(server.stream_url(path), data=body, headers={"Content-Type": JSON})
        assert response.status_code == 204, response.text


def test_metrics_sum_across_workers(start_server: StartServer, unique_stream: str) -> None:
    server = start_server(workers=2)
    body = b'{"n":1}'
    appended, streams = 0, 0
    deadline = time.monotonic() + DEADLINE_SECONDS
    # Append to new streams until both workers have served appends: a stream is served
    # by the worker first asked about its partition, and the kernel picks who accepts.
    while True:
        path = f"{unique_stream}-{streams}"
        create(server, path)
        streams += 1
        for _ in range(5):
            append_on_new_connection(server, path, body)
            appended += 1
        workers = {e["pid"] for e in access_log(server) if e["method"] == "POST"}
        if len(workers) == 2:
            break
        assert time.monotonic() < deadline, "one worker served every stream"

    for _ in range(5):  # whichever worker answers the scrape, the sums are the same
        samples = scrape(server)
        assert samples['picomq_appends_total{content_type="application/json"}'] == appended
        assert samples['picomq_append_bytes_total{content_type="application/json"}'] == (
            appended * len(body)
        )
        assert samples["picomq_commit_batch_size_sum"] == appended
        assert samples['picomq_storage_requests_total{operation="put"}'] >= appended + 1


def test_metric_updates_of_appends_answered_together_are_all_written(
    start_server: StartServer, unique_stream: str
) -> None:
    """Appends committed together are answered in one turn of the worker's event loop,
    which writes their metric updates in one go when it ends: none may be lost, and a
    counter added up must come out as the sum of its updates."""
    server = start_server(workers=1)
    # Four streams: commits of several appends each, and several commits a turn.
    paths = [f"{unique_stream}-{n}" for n in range(4)]
    for path in paths:
        create(server, path)
    body = b'{"n":1}'
    senders, rounds = 32, 10
    start = threading.Barrier(senders)

    def send(number: int) -> None:
        start.wait(timeout=DEADLINE_SECONDS)
        with requests.Session() as session:
            for _ in range(rounds):
                path = paths[number % len(paths)]
                response = session.post(
                    server.stream_url(path), data=body, headers={"Content-Type": JSON}, timeout=10
                )
                assert response.status_code == 204, response.text

    before = scrape(server)
    threads = [threading.Thread(target=send, args=(n,)) for n in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_SECONDS)
    after = scrape(server)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    appended = senders * rounds
    assert added('picomq_appends_total{content_type="application/json"}') == appended
    assert added('picomq_append_bytes_total{content_type="application/json"}') == appended * len(
        body
    )
    assert added("picomq_commit_batch_size_sum") == appended
    commits = added("picomq_commit_batch_size_count")
    assert 0 < commits <= appended
    puts = added('picomq_storage_requests_total{operation="put"}')
    assert puts == added('picomq_storage_seconds_count{operation="put"}')
    assert 0 < puts <= commits  # one log object holds the commits of one or more streams


def test_appends_count_under_their_own_content_type(server: Server, unique_stream: str) -> None:
    bodies = {JSON: [b'{"n":1}', b'[{"n":2},{"n":3}]'], "text/plain": [b"hello", b"hi"]}
    before = scrape(server)
    for content_type, sent in bodies.items():
        create(server, f"{unique_stream}-{content_type}", content_type)
        for body in sent:
            response = requests.post(
                server.stream_url(f"{unique_stream}-{content_type}"),
                data=body,
                headers={"Content-Type": f"{content_type}; charset=utf-8"},
                timeout=10,
            )
            assert response.status_code == 204, response.text
    samples = scrape(server)
    for content_type, sent in bodies.items():
        label = f'{{content_type="{content_type}"}}'
        appends, sizes = f"picomq_appends_total{label}", f"picomq_append_bytes_total{label}"
        assert samples[appends] - before.get(appends, 0) == len(sent)
        assert samples[sizes] - before.get(sizes, 0) == sum(map(len, sent))


def test_metrics_count_reads_live_connections_and_errors(
    start_server: StartServer, unique_stream: str
) -> None:
    server = start_server(long_poll_timeout=0.3)
    create(server, unique_stream)
    url = server.stream_url(unique_stream)
    before = scrape(server)  # the fixture's readiness probe was a read (a 404) already
    requests.get(url, params={"offset": "-1"}, timeout=10)
    requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=10)
    requests.get(server.stream_url(f"{unique_stream}-missing"), timeout=10)

    samples = scrape(server)
    for name, added in (
        ('picomq_reads_total{mode="catch-up"}', 2),
        ('picomq_reads_total{mode="long-poll"}', 1),
        ('picomq_errors_total{status="404"}', 1),
    ):
        assert samples[name] - before.get(name, 0) == added, name
    assert samples.get('picomq_live_connections{mode="sse"}', 0) == 0

    follower = requests.get(url, params={"offset": "-1", "live": "sse"}, stream=True, timeout=10)
    try:
        assert follower.status_code == 200
        next(follower.iter_lines())  # the first event: the response is open
        assert scrape(server)['picomq_live_connections{mode="sse"}'] == 1
    finally:
        follower.close()
    # The server notices the hang-up on its next keep-alive event and lets go.
    wait_for(lambda: scrape(server)['picomq_live_connections{mode="sse"}'] == 0, "the SSE to close")
    assert scrape(server)['picomq_reads_total{mode="sse"}'] == 1


SSE_SUBSCRIBERS = 40
SSE_EVENTS = 10


def follow_sse(url: str, events: int, seen: list[int]) -> None:
    """Read an SSE response until `events` data events arrived; count them into `seen`."""
    params = {"offset": "-1", "live": "sse"}
    with requests.get(url, params=params, stream=True, timeout=DEADLINE_SECONDS) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == b"event: data":
                seen.append(1)
                if len(seen) == events:
                    return


def storage_reads(server: Server) -> float:
    samples = scrape(server)
    return sum(
        samples.get(f'picomq_storage_requests_total{{operation="{operation}"}}', 0.0)
        for operation in ("get", "head", "list")
    )


def test_sse_subscribers_cost_no_storage_request_per_event(
    start_server: StartServer, unique_stream: str
) -> None:
    """Thousands of subscribers must not mean thousands of storage checks per message:
    a subscriber back for the next event trusts a tail confirmed moments ago."""
    server = start_server(long_poll_timeout=2)  # SSE waits end soon after the test
    create(server, unique_stream)
    url = server.stream_url(unique_stream)
    seen: list[list[int]] = [[] for _ in range(SSE_SUBSCRIBERS)]
    readers = [
        threading.Thread(target=follow_sse, args=(url, SSE_EVENTS, counts), daemon=True)
        for counts in seen
    ]
    for reader in readers:
        reader.start()
    wait_for(
        lambda: scrape(server).get('picomq_live_connections{mode="sse"}') == SSE_SUBSCRIBERS,
        "every subscriber to connect",
    )
    before = storage_reads(server)
    for number in range(SSE_EVENTS):
        response = requests.post(url, data=f'{{"n":{number}}}', headers={"Content-Type": JSON})
        assert response.status_code == 204, response.text
        wait_for(lambda n=number: all(len(c) > n for c in seen), f"event {number}")
    for reader in readers:
        reader.join(DEADLINE_SECONDS)
    deliveries = SSE_SUBSCRIBERS * SSE_EVENTS
    storage_requests = storage_reads(server) - before
    # Polling for other processes' appends costs a stat per 50 ms, whatever the audience.
    assert storage_requests < deliveries / 4, (storage_requests, deliveries)


def test_a_waiting_long_poll_reads_nothing_from_a_local_disk(
    start_server: StartServer, unique_stream: str
) -> None:
    """Looking for other processes' appends twenty times a second is a stat, not a read."""
    server = start_server(long_poll_timeout=2)
    create(server, unique_stream)
    before = storage_reads(server)
    response = requests.get(
        server.stream_url(unique_stream),
        params={"offset": "now", "live": "long-poll"},
        timeout=DEADLINE_SECONDS,
    )
    assert response.status_code == 204, response.text  # it waited the whole 2 s
    assert storage_reads(server) - before < 4  # the handle's checks, not 40 polls


def test_a_killed_worker_leaves_no_live_connections_behind(
    start_server: StartServer, unique_stream: str
) -> None:
    server = start_server(long_poll_timeout=5)
    create(server, unique_stream)
    url = server.stream_url(unique_stream)

    def wait_on_the_worker() -> None:
        try:
            requests.get(url, params={"offset": "-1", "live": "long-poll"}, timeout=20)
        except requests.ConnectionError:
            pass  # expected: the worker holding this request is killed

    waiting = threading.Thread(target=wait_on_the_worker)
    waiting.start()
    wait_for(
        lambda: scrape(server).get('picomq_live_connections{mode="long-poll"}') == 1,
        "the long-poll to start",
    )
    # The access line is written after the response, so the scrape can come back first.
    wait_for(lambda: metrics_workers(server), "the scrape's access-log line")
    [worker] = metrics_workers(server)
    os.kill(worker, signal.SIGKILL)  # gunicorn starts another worker in its place
    waiting.join(timeout=DEADLINE_SECONDS)
    wait_for(
        lambda: scrape_or_none(server, 'picomq_live_connections{mode="long-poll"}') == 0,
        "the dead worker's gauge to go",
    )


def metrics_workers(server: Server) -> set[int]:
    return {entry["pid"] for entry in access_log(server) if entry["path"] == "/metrics"}


def scrape_or_none(server: Server, name: str) -> float | None:
    try:
        return scrape(server).get(name, 0)
    except requests.ConnectionError:
        return None  # between the old worker and the new one


# -- logs --------------------------------------------------------------------------------------


def test_logs_are_json_with_the_request_id_and_no_secrets(
    server: Server, unique_stream: str
) -> None:
    create(server, unique_stream)
    secret_body = b'{"secret":"body-words-never-logged"}'
    request_id = f"test-{uuid.uuid4().hex}"
    response = requests.post(
        server.stream_url(unique_stream),
        params={"token": "query-token-never-logged"},
        data=secret_body,
        headers={
            "Content-Type": JSON,
            "X-Request-Id": request_id,
            "Authorization": "Bearer header-token-never-logged",
        },
        timeout=10,
    )
    assert response.status_code == 204
    assert response.headers["X-Request-Id"] == request_id
    assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]

    wait_for(lambda: any(e.get("request_id") == request_id for e in access_log(server)), "log")
    [entry] = [e for e in access_log(server) if e.get("request_id") == request_id]
    assert entry["method"] == "POST"
    assert entry["path"] == f"/v1/stream/{unique_stream}"
    assert entry["status"] == 204
    assert entry["query"] == {}
    output = server.output()
    for secret in ("body-words-never-logged", "query-token-never-logged", "header-token"):
        assert secret not in output


def test_a_forged_request_id_is_replaced(server: Server) -> None:
    response = requests.get(
        f"{server.url}/healthz", headers={"X-Request-Id": 'x" {"level":"forged"}'}, timeout=10
    )
    generated = response.headers["X-Request-Id"]
    assert len(generated) == 32 and generated.isalnum()
    other = requests.get(f"{server.url}/healthz", timeout=10).headers["X-Request-Id"]
    assert other != generated


def test_auth_failures_count_refusals_but_not_fenced_producers(
    start_server: StartServer, unique_stream: str
) -> None:
    secret = "ops-test-secret-of-at-least-32-bytes!!"
    server = start_server(env={"PICOMQ_JWT_SECRET": secret})
    token = mint_token(secret, "HS256", "admin:** create:** append:**", 600)
    admin = {"Authorization": f"Bearer {token}"}

    def auth_failures() -> float:
        response = requests.get(f"{server.url}/metrics", headers=admin, timeout=10)
        assert response.status_code == 200
        lines = response.text.splitlines()
        [line] = [line for line in lines if line.startswith("picomq_auth_failures_total ")]
        return float(line.split()[1])

    before = auth_failures()  # the fixture's readiness probe had no token
    url = server.stream_url(unique_stream)
    assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 401
    assert requests.put(url, headers={"Content-Type": JSON, **admin}).status_code == 201
    producer = {"Content-Type": JSON, "Producer-Id": "p", "Producer-Seq": "0", **admin}
    assert requests.post(url, data=b"1", headers={**producer, "Producer-Epoch": "1"}).ok
    fenced = requests.post(url, data=b"2", headers={**producer, "Producer-Epoch": "0"})
    assert fenced.status_code == 403  # a stale producer epoch, not a credential problem
    assert requests.get(url, timeout=10).status_code == 401
    assert auth_failures() - before == 2
