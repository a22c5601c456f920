"""The `picomq` command line: run a server, and use any PicoMQ server from a shell.

Every client command talks HTTP to `--url` (or PICOMQ_URL) with the token in
PICOMQ_TOKEN, if any, as a bearer token (never a flag: flags end up in shell
history and process lists). Output that scripts read goes to stdout; progress and
errors go to stderr, errors as one line. Exit codes, for scripts:

    0 success               3 stream not found or deleted   6 server or storage unavailable
    1 request rejected      4 conflict (exists, closed)     130 interrupted (Ctrl-C)
    2 usage error           5 not authorised
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn
from urllib.parse import quote, unquote, urlsplit

import click
import msgspec
import requests

from decimals import parse_decimal
from settings import Settings, SettingsError

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_URL = "http://127.0.0.1:4437"
JSON = "application/json"
JSON_MESSAGES = msgspec.json.Decoder(list[msgspec.Raw])
REQUEST_TIMEOUT_SECONDS = 60
LONG_POLL_TIMEOUT_SECONDS = 120  # longer than any server's long-poll wait
BATCH_BYTES = 1024 * 1024
BATCH_LINES = 1000
PROGRESS_MIN_BYTES = 1024 * 1024
RETRY_DELAYS_SECONDS = (0.5, 1, 2, 4, 5)
START_OFFSET = "-1"

EXIT_REJECTED = 1
EXIT_NOT_FOUND = 3
EXIT_CONFLICT = 4
EXIT_DENIED = 5
EXIT_UNAVAILABLE = 6
EXIT_INTERRUPTED = 130

NEXT_OFFSET = "Stream-Next-Offset"
UP_TO_DATE = "Stream-Up-To-Date"
CLOSED = "Stream-Closed"
CURSOR = "Stream-Cursor"


class Failure(click.ClickException):
    """One line on stderr, and the exit code scripts rely on."""

    def __init__(self, message: str, exit_code: int = EXIT_REJECTED) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"picomq: {self.message}", err=True)


def exit_code_of_status(status: int) -> int:
    if status in (404, 410):
        return EXIT_NOT_FOUND
    if status == 409:
        return EXIT_CONFLICT
    if status in (401, 403):
        return EXIT_DENIED
    if status >= 500:
        return EXIT_UNAVAILABLE
    return EXIT_REJECTED


def error_message(response: requests.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):  # HEAD answers carry no body
        path = urlsplit(response.url).path
        message = f"{(response.reason or 'error').lower()}: {unquote(path)}"
    return f"{message} ({response.status_code})"


# -- the HTTP client -------------------------------------------------------------------


@dataclass
class Client:
    """Requests to one server; any answer outside `expected` becomes a `Failure`."""

    base_url: str
    token: str | None
    session: requests.Session

    def stream_url(self, path: str) -> str:
        return f"{self.base_url}/v1/stream/{quote(path.strip('/'), safe='/')}"

    def send(
        self,
        method: str,
        url: str,
        *,
        expected: tuple[int, ...] = (200, 201, 204),
        timeout: float = REQUEST_TIMEOUT_SECONDS,
        **options: Any,
    ) -> requests.Response:
        headers = options.pop("headers", {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            response = self.session.request(
                method, url, headers=headers, timeout=timeout, **options
            )
        except requests.RequestException as error:
            message = f"cannot reach {self.base_url}: {reason(error)}"
            raise Failure(message, EXIT_UNAVAILABLE) from None
        if response.status_code not in expected:
            raise Failure(error_message(response), exit_code_of_status(response.status_code))
        return response

    def head(self, path: str) -> requests.Response:
        return self.send("HEAD", self.stream_url(path), expected=(200,))


def reason(error: requests.RequestException) -> str:
    text = str(error.__context__ or error)
    return "connection refused" if "refused" in text.lower() else type(error).__name__


def client_command(function: Any) -> Any:
    """A subcommand that talks to a server: `--url`/PICOMQ_URL, token from PICOMQ_TOKEN."""

    @click.option(
        "--url",
        envvar="PICOMQ_URL",
        default=DEFAULT_URL,
        show_default=True,
        help="Server base URL (env PICOMQ_URL).",
    )
    @click.pass_context
    def with_client(context: click.Context, url: str, **arguments: Any) -> Any:
        session = context.with_resource(requests.Session())
        client = Client(url.rstrip("/"), os.environ.get("PICOMQ_TOKEN") or None, session)
        return context.invoke(function, client, **arguments)

    with_client.__name__ = function.__name__
    with_client.__doc__ = function.__doc__
    for parameter in getattr(function, "__click_params__", []):
        with_client.__click_params__.append(parameter)
    return with_client


class WholeNumber(click.ParamType):
    """A number option, read as the server reads numbers (decimals.py), at least `minimum`."""

    name = "integer"

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    def convert(self, value: object, parameter: Any, context: Any) -> int:
        try:
            number = parse_decimal(str(value))
        except ValueError as error:
            self.fail(str(error), parameter, context)
        if number < self.minimum:
            self.fail(f"must be at least {self.minimum}", parameter, context)
        return number


def offset_number(offset: str) -> int:
    return int(offset.rsplit("_", 1)[-1])


# -- the group -------------------------------------------------------------------------------


class CommandGroup(click.Group):
    """click's group, with the exit codes above: Ctrl-C is 130, a closed pipe is quiet."""

    def main(self, *arguments: Any, **options: Any) -> NoReturn:
        options["standalone_mode"] = False
        try:
            super().main(*arguments, **options)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.ClickException as error:
            error.show()
            sys.exit(error.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # `picomq tail … | head`: the reader has gone
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_REJECTED)
        sys.exit(0)


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """PicoMQ: durable streams over HTTP."""


@main.command()
@click.option("--bind", help="Address to listen on (PICOMQ_BIND; default 127.0.0.1:4437).")
@click.option("--storage-url", help="Directory or fsspec URL (PICOMQ_STORAGE_URL; ./data).")
@click.option("--workers", type=WholeNumber(minimum=1), help="gunicorn workers (PICOMQ_WORKERS).")
def serve(bind: str | None, storage_url: str | None, workers: int | None) -> NoReturn:
    """Run the server: gunicorn with gevent workers and the repository's gunicorn.conf.py."""
    environment = dict(os.environ)
    for name, value in (("BIND", bind), ("STORAGE_URL", storage_url), ("WORKERS", workers)):
        if value is not None:
            environment[f"PICOMQ_{name}"] = str(value)
    try:
        settings = Settings.from_environment(environment)
    except SettingsError as error:
        raise Failure(f"invalid setting: {error}", 2) from None
    click.echo(f"PicoMQ: http://{settings.bind}/  (streams: /v1/stream/<path>)")
    click.echo(f"Storage: {settings.storage_url}  Workers: {settings.workers}")
    sys.stdout.flush()
    command = [sys.executable, "-m", "gunicorn", "-c", str(REPO_DIR / "gunicorn.conf.py")]
    command.append("wsgi:app")
    # gunicorn.conf.py imports settings.py before gunicorn reads --pythonpath.
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(REPO_DIR), environment.get("PYTHONPATH")))
    )
    os.execve(sys.executable, command, environment)


@main.command()
@click.argument("path")
@click.option("--content-type", "-t", default=JSON, show_default=True)
@click.option("--ttl", type=WholeNumber(minimum=0), help="Seconds to keep it after its last use.")
@click.option("--expires-at", help="RFC 3339 time at which it goes away.")
@client_command
def create(
    client: Client, path: str, content_type: str, ttl: int | None, expires_at: str | None
) -> None:
    """Create a stream (succeeds if it exists with the same settings); prints its offset."""
    headers = {"Content-Type": content_type}
    if ttl is not None:
        headers["Stream-TTL"] = str(ttl)
    if expires_at is not None:
        headers["Stream-Expires-At"] = expires_at
    response = client.send("PUT", client.stream_url(path), headers=headers, expected=(200, 201))
    click.echo(response.headers.get(NEXT_OFFSET, ""))


@main.command()
@click.argument("path")
@click.argument("message", required=False)
@click.option(
    "--progress/--no-progress", default=None, help="Bar on stderr (default: large files)."
)
@click.option(
    "--if-match",
    metavar="OFFSET",
    help="Append only if the stream's tail is still OFFSET (else exit 4, naming the tail).",
)
@client_command
def append(
    client: Client, path: str, message: str | None, progress: bool | None, if_match: str | None
) -> None:
    """Append MESSAGE, or each line of stdin as one message; prints the new offset.

    On a JSON stream each message must be one JSON value (an array stays one message);
    on other streams the bytes are appended as given, a line keeping its newline. With
    --if-match each batch names the tail the one before left, so no other writer's
    append comes between them: one that does stops the rest.
    """
    content_type = client.head(path).headers.get("Content-Type", "application/octet-stream")
    is_json = content_type.split(";")[0].strip().lower() == JSON
    if message is not None:
        batches: Iterator[bytes] = iter([encode_batch([message.encode()], is_json, 1)])
    else:
        batches = read_batches(sys.stdin.buffer, is_json, progress)
    offset, tail = "", if_match.strip('"') if if_match is not None else None
    for body in batches:
        headers = {"Content-Type": content_type}
        if tail is not None:
            headers["If-Match"] = f'"{tail}"'
        url = client.stream_url(path)
        response = client.send("POST", url, data=body, headers=headers, expected=(200, 204, 412))
        if response.status_code == 412:
            moved = f"{error_message(response)}: the tail is at {response.headers[NEXT_OFFSET]}"
            raise Failure(moved, EXIT_CONFLICT)
        offset = response.headers.get(NEXT_OFFSET, offset)
        tail = offset if tail is not None else None
    click.echo(offset)


def read_batches(source: IO[bytes], is_json: bool, progress: bool | None) -> Iterator[bytes]:
    """Request bodies of up to BATCH_LINES lines or about BATCH_BYTES each."""
    size = input_size(source)
    if progress is None:
        progress = size is not None and size >= PROGRESS_MIN_BYTES
    bar = None
    if progress:
        bar = click.progressbar(length=size, label="appending", file=sys.stderr)
        bar.__enter__()
    try:
        lines, length, number = [], 0, 0
        for line in source:
            number += 1
            if bar is not None:
                bar.update(len(line))
            if is_json and not line.strip():
                continue
            lines.append(line)
            length += len(line)
            if len(lines) >= BATCH_LINES or length >= BATCH_BYTES:
                yield encode_batch(lines, is_json, number - len(lines) + 1)
                lines, length = [], 0
        if lines:
            yield encode_batch(lines, is_json, number - len(lines) + 1)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def input_size(source: IO[bytes]) -> int | None:
    """Bytes left in a regular file; None for a pipe or a terminal."""
    try:
        status = os.fstat(source.fileno())
    except (OSError, ValueError):
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def encode_batch(lines: list[bytes], is_json: bool, first_line: int) -> bytes:
    """JSON: `[line, line, …]`, each line checked to be one JSON value; else the bytes."""
    if not is_json:
        return b"".join(lines)
    for number, line in enumerate(lines, first_line):
        try:
            msgspec.json.decode(line)  # strict as the server is: no NaN, valid UTF-8
        except (msgspec.DecodeError, RecursionError):
            raise Failure(f"line {number} is not one JSON value", EXIT_REJECTED) from None
    return b"[" + b",".join(line.strip() for line in lines) + b"]"


def reading_options(offset_help: str) -> Any:
    """The arguments `read` and `tail` share, as if stacked in this order above the command:
    the stream's path, where to start, where to keep the offset, and the output format."""
    decorators = [
        click.argument("path"),
        click.option("--offset", default=None, help=offset_help),
        click.option(
            "--offset-file", type=click.Path(dir_okay=False), help="Resume from, and save to."
        ),
        click.option(
            "--format", "output", type=click.Choice(["auto", "jsonl", "raw"]), default="auto"
        ),
    ]

    def decorate(function: Any) -> Any:
        for decorator in reversed(decorators):  # the bottom one applies first
            function = decorator(function)
        return function

    return decorate


@main.command()
@reading_options(offset_help="Where to start: -1 (the beginning) or an offset.")
@client_command
def read(
    client: Client, path: str, offset: str | None, offset_file: str | None, output: str
) -> None:
    """Print what the stream holds from an offset, then stop (JSON lines or raw bytes)."""
    position = offset or load_offset(offset_file) or START_OFFSET
    printer = Printer(output)
    while True:
        response = client.send("GET", client.stream_url(path), params={"offset": position})
        printer.write(response)
        position = response.headers.get(NEXT_OFFSET, position)
        save_offset(offset_file, position)
        if response.headers.get(UP_TO_DATE) == "true" or response.headers.get(CLOSED) == "true":
            return


@main.command()
@reading_options(offset_help="Where to start: now (default), -1 or an offset.")
@client_command
def tail(
    client: Client, path: str, offset: str | None, offset_file: str | None, output: str
) -> None:
    """Follow the stream live until it is closed; reconnects by itself, Ctrl-C stops."""
    position = offset or load_offset(offset_file) or "now"
    printer = Printer(output)
    cursor: str | None = None
    failures = 0
    while True:
        params = {"offset": position, "live": "long-poll"}
        if cursor:
            params["cursor"] = cursor
        try:
            response = client.send(
                "GET", client.stream_url(path), params=params, timeout=LONG_POLL_TIMEOUT_SECONDS
            )
        except Failure as failure:
            if failure.exit_code != EXIT_UNAVAILABLE:
                raise
            delay = RETRY_DELAYS_SECONDS[min(failures, len(RETRY_DELAYS_SECONDS) - 1)]
            click.echo(f"picomq: {failure.message}; retrying from {position}", err=True)
            failures += 1
            time.sleep(delay)
            continue
        if failures:
            click.echo(f"picomq: reconnected; resuming from {position}", err=True)
            failures = 0
        if response.status_code == 200:
            printer.write(response)
        position = response.headers.get(NEXT_OFFSET, position)
        cursor = response.headers.get(CURSOR, cursor)
        save_offset(offset_file, position)
        if response.headers.get(CLOSED) == "true":
            return


def load_offset(offset_file: str | None) -> str | None:
    if offset_file is None or not os.path.exists(offset_file):
        return None
    return Path(offset_file).read_text().strip() or None


def save_offset(offset_file: str | None, offset: str) -> None:
    """Write-then-rename, so a crash leaves the old offset or the new one, never half."""
    if offset_file is None or offset in ("now", START_OFFSET):
        return
    temporary = f"{offset_file}.tmp"
    Path(temporary).write_text(offset + "\n")
    os.replace(temporary, offset_file)


class Printer:
    """Writes read responses to stdout: JSON streams as one message a line, else raw."""

    def __init__(self, output: str) -> None:
        self.output = output
        self.stdout = sys.stdout.buffer

    def write(self, response: requests.Response) -> None:
        is_json = response.headers.get("Content-Type", "").split(";")[0].strip() == JSON
        if self.output == "jsonl" and not is_json:
            raise Failure("--format jsonl needs a JSON stream; use raw", EXIT_REJECTED)
        if is_json and self.output != "raw":
            # Each message as the server keeps it, on one line: without a round trip
            # through Python's json, numbers such as 1e400 or 0.1000000000000000055 stay.
            for message in JSON_MESSAGES.decode(response.content):
                self.stdout.write(msgspec.json.format(message, indent=-1) + b"\n")
        else:
            self.stdout.write(response.content)
        self.stdout.flush()


@main.command(name="ls")
@click.argument("prefix", default="")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per stream.")
@client_command
def list_streams(client: Client, prefix: str, as_json: bool) -> None:
    """List streams whose path starts with PREFIX: size, content type, closed, expiry."""
    rows = []
    for stream in iterate_streams(client, prefix):
        if as_json:
            click.echo(json.dumps(stream, separators=(",", ":")))
        else:
            rows.append(format_row(stream))
    if not as_json and rows:
        print_table([("PATH", "BYTES", "CONTENT-TYPE", "CLOSED", "EXPIRES"), *rows])


def iterate_streams(client: Client, prefix: str) -> Iterator[dict[str, Any]]:
    after = None
    while True:
        params = {"prefix": prefix, **({"after": after} if after else {})}
        page = client.send("GET", f"{client.base_url}/v1/streams", params=params).json()
        yield from page["streams"]
        after = page["next"]
        if after is None:
            return


def format_row(stream: dict[str, Any]) -> tuple[str, ...]:
    if stream["ttl"] is not None:
        expires = f"ttl {stream['ttl']}s"
    else:
        expires = stream["expiresAt"] or "-"
    closed = "yes" if stream["closed"] else "no"
    return (stream["path"], str(stream["bytes"]), stream["contentType"], closed, expires)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


@main.command()
@click.argument("path")
@client_command
def head(client: Client, path: str) -> None:
    """Show a stream's content type, size, offset, closed flag and expiry."""
    headers = client.head(path).headers
    offset = headers.get(NEXT_OFFSET, "")
    fields = [
        ("path", path),
        ("content-type", headers.get("Content-Type", "")),
        ("bytes", str(offset_number(offset)) if offset else ""),
        ("next-offset", offset),
        ("closed", "yes" if headers.get(CLOSED) == "true" else "no"),
        ("ttl", headers.get("Stream-TTL", "-")),
        ("expires-at", headers.get("Stream-Expires-At", "-")),
    ]
    for name, value in fields:
        click.echo(f"{name}: {value}")


@main.command()
@click.argument("path")
@client_command
def close(client: Client, path: str) -> None:
    """Close a stream: readers see its end, appends get 409; prints the final offset."""
    response = client.send("POST", client.stream_url(path), headers={CLOSED: "true"})
    click.echo(response.headers.get(NEXT_OFFSET, ""))


@main.command()
@click.argument("path")
@client_command
def rm(client: Client, path: str) -> None:
    """Delete a stream and its data."""
    client.send("DELETE", client.stream_url(path), expected=(204,))


@main.command()
@click.option(
    "--scope",
    required=True,
    help='Space-separated action:pattern grants, e.g. "read:agents/run-42 append:jobs/**".',
)
@click.option("--ttl", default="1h", show_default=True, help="Lifetime: 90s, 15m, 1h, 7d.")
@click.option("--subject", default=None, help="The sub claim: who the token is for.")
@click.option(
    "--private-key",
    envvar="PICOMQ_JWT_PRIVATE_KEY",
    default=None,
    help="Ed25519 or RSA private key, PEM text or a PEM file's path (signs EdDSA or RS256;"
    " env PICOMQ_JWT_PRIVATE_KEY). Without it, PICOMQ_JWT_SECRET signs (HS256).",
)
@click.option("--kid", default=None, help="The key id for the header, with --private-key.")
def token(
    scope: str, ttl: str, subject: str | None, private_key: str | None, kid: str | None
) -> None:
    """Print a token (a JWT) that grants SCOPE for TTL.

    Clients send it as `Authorization: Bearer <token>`, or as `?access_token=` where a
    browser's EventSource cannot set headers. It carries PICOMQ_JWT_AUDIENCE as its
    aud claim when that is set, and a random jti (`revoke --jti`). When
    PICOMQ_JWT_SECRET names several keys, the first signs, and its id is the kid.
    """
    from cryptography.exceptions import UnsupportedAlgorithm

    from auth import load_signing_key, mint_token, parse_ttl

    try:
        settings = Settings.from_environment()
        if private_key:
            key, algorithm = load_signing_key(private_key)
        elif settings.jwt_secret:
            first = settings.jwt_secret[0]
            key, algorithm, kid = first.text.encode(), "HS256", first.kid
        else:
            raise click.UsageError("set PICOMQ_JWT_SECRET, or give --private-key")
        encoded = mint_token(
            key,
            algorithm,
            scope,
            parse_ttl(ttl),
            subject=subject,
            audience=settings.jwt_audience,
            key_id=kid,
        )
    except (SettingsError, ValueError, TypeError, OSError, UnsupportedAlgorithm) as error:
        raise click.ClickException(str(error)) from None
    click.echo(encoded)


@main.command()
@click.option("--jti", default=None, help="Revoke the one token with this jti claim.")
@click.option("--sub", default=None, help="Revoke every token of this sub issued until now.")
@click.option(
    "--until",
    required=True,
    help="When those tokens expire anyway: a unix time (their exp), or 15m, 1h, 7d from now.",
)
@client_command
def revoke(client: Client, jti: str | None, sub: str | None, until: str) -> None:
    """Refuse a token (--jti) or a subject's tokens (--sub) from now on, on every worker
    and node within PICOMQ_REVOCATION_INTERVAL; the token in PICOMQ_TOKEN needs
    admin:v1/revocations. Prints the revocation as JSON."""
    from auth import parse_ttl

    if (jti is None) == (sub is None):
        raise click.UsageError("give --jti or --sub, one of them")
    try:
        expires = parse_decimal(until)
    except ValueError:
        try:
            expires = int(time.time()) + parse_ttl(until)
        except ValueError as error:
            raise click.UsageError(f"--until: {error}") from None
    body = {"jti": jti} if jti is not None else {"sub": sub}
    url = f"{client.base_url}/v1/revocations"
    response = client.send("POST", url, json={**body, "until": expires}, expected=(201,))
    click.echo(response.text)


if __name__ == "__main__":
    main(prog_name="picomq")
