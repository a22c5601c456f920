"""The command line, run as a real process against real servers: output scripts can
parse, one-line errors with the documented exit codes, and `tail` that survives a
server restart and Ctrl-C without losing or repeating a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import requests
from conftest import REPO_DIR
from processes import answers_http, free_port

from auth import mint_token

if TYPE_CHECKING:
    from conftest import Server, StartServer

CLI = [sys.executable, str(REPO_DIR / "cli.py")]
COMMAND_TIMEOUT_SECONDS = 60
DEADLINE_SECONDS = 30.0
JSON_HEADERS = {"Content-Type": "application/json"}


def picomq(
    server_url: str, *arguments: str, input: bytes | None = None, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "PICOMQ_TOKEN"}
    environment["PICOMQ_URL"] = server_url
    if token is not None:
        environment["PICOMQ_TOKEN"] = token
    result = subprocess.run(
        [*CLI, *arguments],
        input=input,
        capture_output=True,
        env=environment,
        timeout=COMMAND_TIMEOUT_SECONDS,
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def start_tail(server: Server, *arguments: str) -> subprocess.Popen[bytes]:
    environment = dict(os.environ, PICOMQ_URL=server.url)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A shell starts background jobs with SIGINT ignored, and a child inherits that:
        # the tail would then never see the Ctrl-C these tests send it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return subprocess.Popen(
        [*CLI, "tail", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment,
        start_new_session=True,
    )


def read_lines(process: subprocess.Popen[bytes], count: int) -> list[str]:
    """The next `count` lines of the process's stdout (the test's timeout bounds a hang)."""
    assert process.stdout is not None
    return [process.stdout.readline().decode().rstrip("\n") for _ in range(count)]


def wait_for_exit(process: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    try:
        stdout, stderr = process.communicate(timeout=DEADLINE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"still running: {stderr.decode()}") from None
    return process.returncode, stdout.decode(), stderr.decode()


# -- the journey ---------------------------------------------------------------------------


def test_create_append_read_ls_head_close_rm(server: Server, unique_stream: str) -> None:
    path = f"{unique_stream}/run"
    assert ok(picomq(server.url, "create", path)).strip() == "0000000000000000_0000000000000000"
    ok(picomq(server.url, "append", path, '{"step":1,"tags":["a"]}'))
    ok(picomq(server.url, "append", path, "[1,2]"))  # one message: an array stays whole
    ok(picomq(server.url, "append", path, input=b'{"step":2}\n\n"three"\n'))

    lines = ok(picomq(server.url, "read", path)).splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "tags": ["a"]},
        [1, 2],
        {"step": 2},
        "three",
    ]

    table = ok(picomq(server.url, "ls", f"{unique_stream}/")).splitlines()
    assert table[0].split() == ["PATH", "BYTES", "CONTENT-TYPE", "CLOSED", "EXPIRES"]
    assert table[1].split() == [path, "49", "application/json", "no", "-"]

    head = ok(picomq(server.url, "head", path)).splitlines()
    assert "closed: no" in head and "bytes: 49" in head

    final = ok(picomq(server.url, "close", path)).strip()
    assert final == "0000000000000000_0000000000000049"
    refused = picomq(server.url, "append", path, "4")
    assert refused.returncode == 4
    assert refused.stderr.strip() == "picomq: stream is closed (409)"
    assert "closed: yes" in ok(picomq(server.url, "head", path)).splitlines()

    ok(picomq(server.url, "rm", path))
    gone = picomq(server.url, "head", path)
    assert gone.returncode == 3
    assert gone.stderr.count("\n") == 1
    assert ok(picomq(server.url, "ls", f"{unique_stream}/")) == ""


def test_read_prints_each_json_message_on_one_line_as_stored(
    server: Server, unique_stream: str
) -> None:
    ok(picomq(server.url, "create", unique_stream))
    sent = b'[{\n  "n" : 1e400,\n  "big": 123456789012345678901234567890\n}, 0.1000000000000000055]'
    response = requests.post(server.stream_url(unique_stream), data=sent, headers=JSON_HEADERS)
    assert response.status_code == 204, response.content
    lines = ok(picomq(server.url, "read", unique_stream)).splitlines()
    assert lines == ['{"n":1e400,"big":123456789012345678901234567890}', "0.1000000000000000055"]


def test_byte_streams_keep_their_bytes_and_ls_shows_expiry(
    server: Server, unique_stream: str
) -> None:
    ok(picomq(server.url, "create", unique_stream, "--content-type", "text/plain", "--ttl", "600"))
    ok(picomq(server.url, "append", unique_stream, input=b"first line\nsecond line\n"))
    ok(picomq(server.url, "append", unique_stream, "no newline"))
    assert ok(picomq(server.url, "read", unique_stream)) == "first line\nsecond line\nno newline"
    listed = json.loads(ok(picomq(server.url, "ls", unique_stream, "--json")))
    assert listed["ttl"] == 600 and listed["contentType"] == "text/plain"
    assert "ttl 600s" in ok(picomq(server.url, "ls", unique_stream))
    refused = picomq(server.url, "read", unique_stream, "--format", "jsonl")
    assert refused.returncode == 1


def test_large_input_is_batched_in_order_with_a_progress_bar(
    server: Server, unique_stream: str, tmp_path: Path
) -> None:
    count = 25_000
    source = tmp_path / "messages.jsonl"
    source.write_text("".join(json.dumps({"n": n, "pad": "x" * 40}) + "\n" for n in range(count)))
    assert source.stat().st_size > 1024 * 1024  # more than one request's worth
    ok(picomq(server.url, "create", unique_stream))
    with source.open("rb") as stdin:
        result = subprocess.run(
            [*CLI, "append", unique_stream],
            stdin=stdin,
            capture_output=True,
            env=dict(os.environ, PICOMQ_URL=server.url),
            timeout=COMMAND_TIMEOUT_SECONDS,
        )
    assert result.returncode == 0, result.stderr
    assert b"appending" in result.stderr  # the bar (its label, when stderr is no terminal)

    read = ok(picomq(server.url, "read", unique_stream, "--offset", "-1"))
    assert [json.loads(line)["n"] for line in read.splitlines()] == list(range(count))


def test_append_if_match_goes_on_only_from_the_tail_it_names(
    server: Server, unique_stream: str
) -> None:
    start = ok(picomq(server.url, "create", unique_stream)).strip()
    first = ok(picomq(server.url, "append", unique_stream, "1", "--if-match", start)).strip()
    # 1,001 lines go as two batches, the second naming the tail the first left.
    lines = b"2\n" * (1000 + 1)
    last = ok(picomq(server.url, "append", unique_stream, "--if-match", first, input=lines))
    assert last.strip() == "0000000000000000_0000000000002004"
    stale = picomq(server.url, "append", unique_stream, "4", "--if-match", first)
    assert stale.returncode == 4
    assert stale.stderr == (
        "picomq: the stream's tail is not the offset If-Match names (412):"
        f" the tail is at {last.strip()}\n"
    )
    assert ok(picomq(server.url, "read", unique_stream)).splitlines() == ["1"] + ["2"] * 1001


# -- errors and exit codes --------------------------------------------------------------------


def test_errors_are_one_line_with_exit_codes(server: Server, unique_stream: str) -> None:
    missing = picomq(server.url, "read", f"{unique_stream}-missing")
    assert missing.returncode == 3
    assert missing.stderr == f"picomq: stream {unique_stream}-missing not found (404)\n"

    ok(picomq(server.url, "create", unique_stream))
    exists_otherwise = picomq(server.url, "create", unique_stream, "-t", "text/plain")
    assert exists_otherwise.returncode == 4

    for bad in (b"{broken", b"NaN", b'"\xff"'):  # Python's json takes NaN; JSON does not
        bad_line = picomq(server.url, "append", unique_stream, input=b'{"ok":1}\n' + bad)
        assert bad_line.returncode == 1, bad
        assert bad_line.stderr == "picomq: line 2 is not one JSON value\n"
    assert ok(picomq(server.url, "read", unique_stream)) == ""  # nothing half-appended

    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = picomq(nobody, "ls")
    assert unreachable.returncode == 6
    assert unreachable.stderr == f"picomq: cannot reach {nobody}: connection refused\n"

    assert picomq(server.url, "tail").returncode == 2  # usage: no path
    for ttl in ("٣", "+3", "9" * 5000):  # int() takes the first two, raises on the third
        bad_ttl = picomq(server.url, "create", f"{unique_stream}-ttl", "--ttl", ttl)
        assert bad_ttl.returncode == 2 and "ASCII digits" in bad_ttl.stderr, ttl
        assert len(bad_ttl.stderr) < 1000, "the error echoes the 5,000 digits"


# -- tail -----------------------------------------------------------------------------------------


def append_numbers(server: Server, path: str, numbers: range) -> None:
    for n in numbers:
        response = requests.post(server.stream_url(path), json={"n": n}, timeout=10)
        assert response.status_code == 204, response.text


def test_tail_resumes_after_a_server_restart_without_gap_or_duplicate(
    start_server: StartServer, unique_stream: str, tmp_path: Path
) -> None:
    server = start_server()
    ok(picomq(server.url, "create", unique_stream))
    append_numbers(server, unique_stream, range(0, 3))
    offset_file = tmp_path / "offset"
    tail = start_tail(server, unique_stream, "--offset", "-1", "--offset-file", str(offset_file))
    try:
        assert read_lines(tail, 3) == ['{"n":0}', '{"n":1}', '{"n":2}']
        append_numbers(server, unique_stream, range(3, 5))
        assert read_lines(tail, 2) == ['{"n":3}', '{"n":4}']

        server.restart()  # tail's next request finds nobody listening, then retries
        append_numbers(server, unique_stream, range(5, 8))
        ok(picomq(server.url, "close", unique_stream))
        code, rest, stderr = wait_for_exit(tail)
    finally:
        if tail.poll() is None:
            os.killpg(tail.pid, signal.SIGKILL)
            tail.wait()
    assert code == 0, stderr
    assert rest.splitlines() == [f'{{"n":{n}}}' for n in range(5, 8)]
    assert "retrying from" in stderr and "reconnected; resuming from" in stderr
    tail_offset = requests.head(server.stream_url(unique_stream)).headers["Stream-Next-Offset"]
    assert offset_file.read_text().strip() == tail_offset


def test_ctrl_c_stops_tail_cleanly_and_the_offset_file_resumes_it(
    server: Server, unique_stream: str, tmp_path: Path
) -> None:
    ok(picomq(server.url, "create", unique_stream))
    offset_file = tmp_path / "offset"
    tail = start_tail(server, unique_stream, "--offset", "-1", "--offset-file", str(offset_file))
    append_numbers(server, unique_stream, range(0, 2))
    assert read_lines(tail, 2) == ['{"n":0}', '{"n":1}']
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not offset_file.exists():  # saved right after the lines are written
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tail.send_signal(signal.SIGINT)
    code, _, stderr = wait_for_exit(tail)
    assert code == 130
    assert "Traceback" not in stderr

    append_numbers(server, unique_stream, range(2, 4))
    ok(picomq(server.url, "close", unique_stream))
    resumed = picomq(server.url, "tail", unique_stream, "--offset-file", str(offset_file))
    assert ok(resumed).splitlines() == ['{"n":2}', '{"n":3}']


# -- serve -----------------------------------------------------------------------------------------


def test_serve_runs_gunicorn_on_the_given_address_and_storage(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    log = tmp_path / "serve.log"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PICOMQ_")}
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*CLI, "serve", "--bind", f"127.0.0.1:{port}", "--storage-url", str(data)],
            cwd=tmp_path,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while not answers_http(port, "/healthz"):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        assert log.read_text().startswith(f"PicoMQ: {url}/")
        ok(picomq(url, "create", "served"))
        ok(picomq(url, "append", "served", '"hello"'))
        assert ok(picomq(url, "read", "served")) == '"hello"\n'
        assert (data / "streams").is_dir()
    finally:
        process.send_signal(signal.SIGTERM)  # the gunicorn master: serve exec'd it
        try:
            process.wait(timeout=DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0


def test_serve_refuses_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [*CLI, "serve", "--bind", "127.0.0.1:1"],
        env=dict(os.environ, PICOMQ_LONG_POLL_TIMEOUT="soon"),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_SECONDS,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("picomq: invalid setting: PICOMQ_LONG_POLL_TIMEOUT=")
    assert result.stderr.count("\n") == 1


# -- access control ---------------------------------------------------------------------------


def test_token_from_the_environment_and_denials_exit_5(
    start_server: StartServer, unique_stream: str
) -> None:
    secret = "cli-test-secret-of-at-least-32-bytes!"
    server = start_server(env={"PICOMQ_JWT_SECRET": secret})
    writer = mint_token(secret, "HS256", "create:** append:** read:**", 600)
    reader = mint_token(secret, "HS256", f"read:{unique_stream}", 600)

    denied = picomq(server.url, "create", unique_stream)
    assert denied.returncode == 5
    assert denied.stderr.startswith("picomq: ") and denied.stderr.count("\n") == 1
    ok(picomq(server.url, "create", unique_stream, token=writer))
    ok(picomq(server.url, "append", unique_stream, '"hi"', token=writer))
    assert ok(picomq(server.url, "read", unique_stream, token=reader)) == '"hi"\n'
    refused = picomq(server.url, "append", unique_stream, '"no"', token=reader)
    assert refused.returncode == 5
    assert reader not in refused.stderr and writer not in refused.stderr
