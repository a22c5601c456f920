"""A reader's journey through the PyPI client `durable-streams` 0.1.0 against a real PicoMQ.

Create, append, catch up, follow live, get interrupted, resume from the saved offset: what
was read must be the stream, with no gap and no duplicate. And the client's known gap (it
does not know closed streams, so its long-poll reader re-polls a closed stream in a tight
loop) must cost the server nothing but cheap 204s.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import requests
from durable_streams import DurableStream, stream

if TYPE_CHECKING:
    from conftest import Server

JSON = "application/json"
FOLLOW_DEADLINE_SECONDS = 30.0
CLOSED_POLL_BUDGET = 300


class BudgetSpent(Exception):
    """Raised from an httpx hook to stop a client loop that would otherwise never end."""


def guarded_client(deadline_seconds: float = FOLLOW_DEADLINE_SECONDS) -> httpx.Client:
    """An httpx client that refuses to send once the deadline has passed (no hung tests)."""
    deadline = time.monotonic() + deadline_seconds

    def check_deadline(request: httpx.Request) -> None:
        if time.monotonic() > deadline:
            raise BudgetSpent(f"still requesting {request.url} after {deadline_seconds} s")

    return httpx.Client(timeout=30.0, event_hooks={"request": [check_deadline]})


def messages(numbers: range) -> list[dict[str, Any]]:
    return [{"n": n, "text": f"message {n}"} for n in numbers]


@pytest.mark.parametrize("live", ["long-poll", "sse"])
def test_follow_interrupt_and_resume_reads_everything_exactly_once(
    server: Server, unique_stream: str, live: str
) -> None:
    url = server.stream_url(unique_stream)
    with DurableStream.create(url, content_type=JSON) as writer:
        for message in messages(range(0, 5)):
            writer.append(message)

        with stream(url, live=False) as catch_up:
            received = catch_up.read_json()
            saved = catch_up.offset
        assert received == messages(range(0, 5))

        # Live: a writer thread appends while we follow; we stop partway (the interruption).
        appender = threading.Thread(
            target=lambda: [writer.append(message) for message in messages(range(5, 15))]
        )
        with guarded_client() as client:
            with stream(url, offset=saved, live=live, client=client) as follower:
                appender.start()
                for event in follower.iter_events(mode="json"):
                    received += event.data
                    saved = event.next_offset
                    if len(received) >= 10:
                        break
        appender.join(timeout=FOLLOW_DEADLINE_SECONDS)
        assert not appender.is_alive()

        for message in messages(range(15, 20)):
            writer.append(message)

    with stream(url, offset=saved, live=False) as resumed:
        received += resumed.read_json()
    assert received == messages(range(0, 20))


def test_byte_stream_resume_from_saved_offset_has_no_gap(
    server: Server, unique_stream: str
) -> None:
    url = server.stream_url(unique_stream)
    chunks = [bytes([n]) * (n + 1) for n in range(30)]
    with DurableStream.create(url, content_type="application/octet-stream") as writer:
        for chunk in chunks[:10]:
            writer.append(chunk)
        with stream(url, live=False) as first:
            received = first.read_bytes()
            saved = first.offset
        for chunk in chunks[10:20]:
            writer.append(chunk)
        with guarded_client() as client:
            with stream(url, offset=saved, live="long-poll", client=client) as follower:
                for event in follower.iter_events(mode="bytes"):
                    received += event.data
                    saved = event.next_offset
                    break
        for chunk in chunks[20:]:
            writer.append(chunk)
    with stream(url, offset=saved, live=False) as resumed:
        received += resumed.read_bytes()
    assert received == b"".join(chunks)


def test_text_lines_keep_their_leading_spaces_through_sse(
    server: Server, unique_stream: str
) -> None:
    """SSE parsers drop one space after `data:`: a line that starts with one must not
    lose it, nor a line after a line break inside the stream's text."""
    url = server.stream_url(unique_stream)
    text = " one space\n  two spaces\nnone\n\tand a tab\n "
    headers = {"Content-Type": "text/plain", "Stream-Closed": "true"}
    assert requests.put(url, data=text.encode(), headers=headers).status_code == 201
    with guarded_client() as client:
        with stream(url, offset="-1", live="sse", client=client) as follower:
            received = "".join(event.data for event in follower.iter_events(mode="text"))
    assert received == text


def test_client_polling_a_closed_stream_in_a_loop_gets_cheap_204s(
    server: Server, unique_stream: str
) -> None:
    """The 0.1.0 client ignores Stream-Closed and re-polls at once; bound it by a budget."""
    url = server.stream_url(unique_stream)
    with DurableStream.create(url, content_type=JSON) as writer:
        writer.append({"last": "words"})
    closing = requests.post(url, headers={"Stream-Closed": "true"})
    assert closing.status_code == 204
    final_offset = closing.headers["Stream-Next-Offset"]

    polls: list[httpx.Response] = []

    def spend_budget(request: httpx.Request) -> None:
        if len(polls) >= CLOSED_POLL_BUDGET:
            raise BudgetSpent(f"{len(polls)} requests")

    outcome: dict[str, object] = {"events": []}

    def follow() -> None:
        hooks = {"request": [spend_budget], "response": [polls.append]}
        with httpx.Client(timeout=30.0, event_hooks=hooks) as client:
            try:
                with stream(url, offset="-1", live="long-poll", client=client) as reader:
                    for event in reader.iter_events(mode="json"):
                        outcome["events"].append(event.data)
            except BudgetSpent:
                outcome["stopped"] = "budget"
            except Exception as error:  # reported by the assertions below
                outcome["stopped"] = repr(error)

    reader_thread = threading.Thread(target=follow, daemon=True)
    reader_thread.start()
    checks = 0
    while reader_thread.is_alive() or checks == 0:
        assert_other_clients_are_served(server, f"{unique_stream}-other-{checks}")
        checks += 1
    reader_thread.join(timeout=FOLLOW_DEADLINE_SECONDS)
    assert not reader_thread.is_alive()

    assert outcome["stopped"] == "budget", outcome
    assert outcome["events"] == [[{"last": "words"}]]
    assert len(polls) == CLOSED_POLL_BUDGET, "the pinned client no longer loops: revisit"
    first, *repeats = polls
    assert first.status_code == 200
    assert first.headers["Stream-Closed"] == "true"
    for poll in repeats:
        assert poll.status_code == 204, poll.status_code
        assert poll.headers["Stream-Closed"] == "true"
        assert poll.headers["Stream-Up-To-Date"] == "true"
        assert poll.headers["Stream-Next-Offset"] == final_offset

    head = requests.head(url)
    assert head.status_code == 200 and head.headers["Stream-Closed"] == "true"
    assert requests.get(url).json() == [{"last": "words"}]
    assert_other_clients_are_served(server, f"{unique_stream}-after")


def assert_other_clients_are_served(server: Server, path: str) -> None:
    url = server.stream_url(path)
    with DurableStream.create(url, content_type=JSON) as handle:
        handle.append({"path": path})
    with stream(url, live=False) as reader:
        assert reader.read_json() == [{"path": path}]
