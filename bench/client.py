"""A small asyncio HTTP/1.1 client for the benchmark's reads, live reads and fan-out.

Plain asyncio streams and protocols, no dependency: keep-alive connections, bodies framed
by Content-Length, chunked encoding or the end of the connection, and an SSE subscriber
that finds message ids in the event stream without parsing more than it must — 10,000 of
them share one core with the producer. Clients never send Accept-Encoding, so both
servers answer with identity bodies.

Every message the live loads write carries its number as `"i":<n>`; the SSE subscriber
and the long-poll reader report each number they see, with the time it arrived. They
never reconnect, so a number seen twice would be the server's duplicate.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from servers import HOST

READ_PIECE_BYTES = 1 << 20
READER_LIMIT_BYTES = 1 << 20
MESSAGE_ID = re.compile(rb'"i":(\d+)')
MessageHandler = Callable[[int, float], None]


class HttpError(RuntimeError):
    """The server broke HTTP framing or closed the connection mid-response."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes
    first_byte_at: float  # time.monotonic() when the status line arrived


class Connection:
    """One keep-alive HTTP/1.1 connection to HOST:port, reopened when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            HOST, self.port, limit=READER_LIMIT_BYTES
        )

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None

    async def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        sink: Callable[[bytes], None] | None = None,
    ) -> Response:
        """Send one request and read its whole response.

        With `sink`, body pieces go to it as they arrive and `Response.body` is empty (a
        50 MB read is counted, not kept). A keep-alive connection the server closed while
        idle is reopened and the request sent once more; any other failure raises.
        """
        reused = self.writer is not None and not self.writer.is_closing()
        if not reused:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(format_request(method, path, headers, body))
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            await self.close()
            if reused and not getattr(error, "partial", b""):
                return await self.request(method, path, headers, body, sink)
            raise HttpError(f"{method} {path}: connection closed before the response") from error
        first_byte_at = time.monotonic()
        status, response_headers = parse_head(head)
        pieces: list[bytes] = []
        if method != "HEAD" and status not in (204, 304):
            await self.read_body(response_headers, sink or pieces.append)
        if response_headers.get("connection", "").lower() == "close":
            await self.close()
        return Response(status, response_headers, b"".join(pieces), first_byte_at)

    async def read_body(self, headers: dict[str, str], sink: Callable[[bytes], None]) -> None:
        assert self.reader is not None
        reader = self.reader
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    await read_exactly(reader, size, sink)
                    await reader.readexactly(2)
                await reader.readuntil(b"\r\n")  # no trailers are expected
            elif "content-length" in headers:
                await read_exactly(reader, int(headers["content-length"]), sink)
            else:
                while piece := await reader.read(READ_PIECE_BYTES):
                    sink(piece)
                await self.close()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as error:
            await self.close()
            raise HttpError(f"response body cut short: {error}") from error


async def read_exactly(
    reader: asyncio.StreamReader, size: int, sink: Callable[[bytes], None]
) -> None:
    while size > 0:
        piece = await reader.read(min(size, READ_PIECE_BYTES))
        if not piece:
            raise asyncio.IncompleteReadError(b"", size)
        sink(piece)
        size -= len(piece)


def format_request(
    method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise HttpError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class SseSubscriber(asyncio.Protocol):
    """One SSE reader; calls `on_message(i, arrived_at)` for each message number it sees.

    `ready` resolves at the first control event (the subscription is live) or fails if
    the answer is not 200; `lost` resolves when the connection or the response ends (the
    subscriber does not reconnect). Only complete events
    are scanned, so a number split across two TCP reads is seen once, whole.
    """

    def __init__(self, path: str, on_message: MessageHandler) -> None:
        loop = asyncio.get_running_loop()
        self.request = format_request("GET", path, {"Accept": "text/event-stream"})
        self.on_message = on_message
        self.ready: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        arrived_at = time.monotonic()
        buffer = self.pending + data if self.pending else data
        if not self.ready.done() and len(buffer) >= 12 and buffer[9:12] != b"200":
            status_line = buffer.split(b"\r\n", 1)[0].decode("latin-1")
            self.ready.set_exception(HttpError(f"SSE answered {status_line!r}"))
            self.close()
            return
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.pending = buffer
            if buffer.endswith(b"\r\n0\r\n\r\n"):  # the server ended the response
                self.close()
            return
        complete, self.pending = buffer[:cut], buffer[cut + 2 :]
        if not self.ready.done() and b"event: control" in complete:
            self.ready.set_result(None)
        for match in MESSAGE_ID.finditer(complete):
            self.on_message(int(match[1]), arrived_at)

    def connection_lost(self, error: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(HttpError(f"connection lost before the first event: {error}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def subscribe(port: int, path: str, on_message: MessageHandler) -> SseSubscriber:
    """Open an SSE subscription; returns once connected (await `.ready` for the first event)."""
    loop = asyncio.get_running_loop()
    _, subscriber = await loop.create_connection(
        lambda: SseSubscriber(path, on_message), HOST, port
    )
    return subscriber


def find_message_ids(body: bytes) -> list[int]:
    return [int(match[1]) for match in MESSAGE_ID.finditer(body)]
