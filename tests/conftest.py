"""Real servers for the tests: PicoMQ under gunicorn (gunicorn.conf.py), `moto_server` for S3,
nginx with the shipped site in front of one PicoMQ or several.

Each server runs in its own process group on a free 127.0.0.1 port, with its output in a
log file. Readiness is polled with a deadline; a server that exits or never answers fails
the test with its output. Teardown signals only the processes these fixtures started.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import gevent
import processes
import pytest
import requests
from faultproxy import FaultProxy, Record
from nginx_site import nginx_config, site_for

if TYPE_CHECKING:
    from storage import StreamStore

REPO_DIR = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent
READINESS_PATH = "/v1/stream/__readiness-probe"
DEFAULT_LONG_POLL_TIMEOUT = 0.5
NGINX_LOG_DEADLINE_SECONDS = 10


def kernel_watches_directories() -> bool:
    """Whether this kernel hands out an inotify descriptor (Linux; a sandbox may refuse)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        return False
    descriptor = libc.inotify_init1(os.O_CLOEXEC)
    if descriptor < 0:
        return False
    os.close(descriptor)
    return True


NEEDS_INOTIFY = pytest.mark.skipif(
    not kernel_watches_directories(), reason="no inotify here: waiting readers poll"
)


def whole_lines(log: Path) -> list[str]:
    """The lines of a log that servers append to as it is read. A read may see part of
    a line being written (the tail of a write that crosses a page comes later): that
    line waits for the next read."""
    text = log.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def find_executable(name: str) -> Path:
    """The executable installed beside this Python (the venv's bin directory)."""
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} not found: install requirements-dev.txt into this Python's venv")
    return path


class ManagedProcess(processes.ManagedProcess):
    """A test's server process: a start that fails fails the test, with the output."""

    def start(self) -> None:
        try:
            super().start()
        except processes.ProcessFailed as error:
            pytest.fail(str(error))


@dataclass
class Server:
    """A running PicoMQ: `url` is the base URL; streams live under `url + "/v1/stream/"`."""

    url: str
    data_dir: Path
    env: dict[str, str]
    managed: ManagedProcess

    @property
    def pid(self) -> int:
        return self.managed.pid

    def stream_url(self, path: str) -> str:
        return f"{self.url}/v1/stream/{path.lstrip('/')}"

    def stop(self) -> None:
        self.managed.stop()

    def kill9(self) -> None:
        self.managed.kill9()

    def start(self) -> None:
        self.managed.start()

    def restart(self) -> None:
        """Stop (gracefully, if still running) and start again: same port and data dir."""
        self.managed.stop()
        self.managed.start()

    def output(self) -> str:
        return self.managed.output()


StartServer = Callable[..., Server]


def server_environment(
    storage_url: str, long_poll_timeout: float, workers: int | None, env: Mapping[str, str]
) -> dict[str, str]:
    """This process's environment without any PICOMQ_* setting, plus the given ones."""
    result = {key: value for key, value in os.environ.items() if not key.startswith("PICOMQ_")}
    result["PYTHONUNBUFFERED"] = "1"
    result["PICOMQ_STORAGE_URL"] = storage_url
    result["PICOMQ_LONG_POLL_TIMEOUT"] = str(long_poll_timeout)
    if workers is not None:
        result["PICOMQ_WORKERS"] = str(workers)
    result.update(env)
    return result


def make_server(
    base_dir: Path,
    *,
    storage_url: str | None = None,
    long_poll_timeout: float = DEFAULT_LONG_POLL_TIMEOUT,
    workers: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    """A PicoMQ (not yet started) with its data and log under base_dir.

    storage_url defaults to base_dir/"data" on local disk; workers=None leaves the count
    to gunicorn.conf.py; env adds or overrides environment variables (e.g. AWS_*).
    """
    data_dir = base_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    # The server's temporary files (metric files, writer locks) stay with the test's,
    # also when a test kills the server before it can remove them.
    temporary_dir = base_dir / "tmp"
    temporary_dir.mkdir(exist_ok=True)
    port = processes.free_port()
    server_env = server_environment(
        storage_url or str(data_dir),
        long_poll_timeout,
        workers,
        {"TMPDIR": str(temporary_dir), **(env or {})},
    )
    command = [
        str(find_executable("gunicorn")),
        "-c",
        "gunicorn.conf.py",
        "--bind",
        f"127.0.0.1:{port}",
        "--no-control-socket",
        "wsgi:app",
    ]
    managed = ManagedProcess(
        name="picomq",
        command=command,
        cwd=REPO_DIR,
        env=server_env,
        log_path=base_dir / "server.log",
        port=port,
        readiness_path=READINESS_PATH,
    )
    return Server(
        url=f"http://127.0.0.1:{port}", data_dir=data_dir, env=server_env, managed=managed
    )


@pytest.fixture
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Factory: `start_server(storage_url=None, long_poll_timeout=0.5, workers=None, env=None)`.

    Each call starts a PicoMQ with a fresh data dir and returns its Server once it answers
    HTTP. Every server started is stopped at the end of the test.
    """
    servers: list[Server] = []

    def start(
        *,
        storage_url: str | None = None,
        long_poll_timeout: float = DEFAULT_LONG_POLL_TIMEOUT,
        workers: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Server:
        server = make_server(
            tmp_path_factory.mktemp("picomq"),
            storage_url=storage_url,
            long_poll_timeout=long_poll_timeout,
            workers=workers,
            env=env,
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One PicoMQ for the session: local disk, long-poll timeout 0.5 s, default workers."""
    shared = make_server(tmp_path_factory.mktemp("picomq-shared"))
    shared.start()
    yield shared
    shared.stop()


def make_moto(base_dir: Path) -> ManagedProcess:
    """A moto_server (not yet started) on a free port, its log under base_dir."""
    port = processes.free_port()
    return ManagedProcess(
        name="moto_server",
        command=[str(find_executable("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        cwd=base_dir,
        env=dict(os.environ),
        log_path=base_dir / "moto.log",
        port=port,
    )


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto_server for the session; yields its endpoint URL. It holds no buckets at first."""
    managed = make_moto(tmp_path_factory.mktemp("moto"))
    managed.start()
    yield f"http://127.0.0.1:{managed.port}"
    managed.stop()


@pytest.fixture
def start_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], ManagedProcess]]:
    """Factory for a moto_server of the test's own (one it may stop); all stopped at the end."""
    started: list[ManagedProcess] = []

    def start() -> ManagedProcess:
        managed = make_moto(tmp_path_factory.mktemp("moto"))
        started.append(managed)
        managed.start()
        return managed

    yield start
    for managed in started:
        managed.stop()


@dataclass
class Nginx:
    """A running nginx: `url` is its base URL; its logs are in `base_dir`."""

    url: str
    base_dir: Path
    managed: ManagedProcess

    def access_lines(self, naming: str, count: int = 1) -> list[str]:
        """The lines of its access log that contain `naming`, once there are `count`.

        A line (request id, status, URI, the upstream that answered and the client
        connection's number: nginx_site.py) is written after the response is sent, so
        this waits for them, at most NGINX_LOG_DEADLINE_SECONDS.
        """
        deadline = time.monotonic() + NGINX_LOG_DEADLINE_SECONDS
        while True:
            log = whole_lines(self.base_dir / "access.log")
            lines = [line for line in log if naming in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)


StartNginx = Callable[[Sequence[Server]], Nginx]


def make_nginx(base_dir: Path, servers: Sequence[Server]) -> Nginx:
    """nginx (not yet started) on a free port, the shipped site in front of `servers`,
    taking them in turn; its configuration and logs under base_dir."""
    executable = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(executable).exists():
        pytest.fail("nginx not found: run ./test.sh (installs it as root on Debian)")
    port = processes.free_port()
    picomq_ports = [server.managed.port for server in servers]
    config = nginx_config(base_dir, site_for(picomq_ports, port), port)
    managed = ManagedProcess(
        name="nginx",
        command=[executable, "-c", str(config), "-p", str(base_dir)],
        cwd=base_dir,
        env=dict(os.environ),
        log_path=base_dir / "nginx.out",
        port=port,
        readiness_path="/healthz",
    )
    return Nginx(f"http://127.0.0.1:{port}", base_dir, managed)


@pytest.fixture
def start_nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartNginx]:
    """Factory: `start_nginx(servers)` starts an nginx in front of the running servers and
    returns it once it answers HTTP. Every nginx started is stopped at the end of the test."""
    started: list[Nginx] = []

    def start(servers: Sequence[Server]) -> Nginx:
        nginx = make_nginx(tmp_path_factory.mktemp("nginx"), servers)
        started.append(nginx)
        nginx.managed.start()
        return nginx

    yield start
    for nginx in started:
        nginx.managed.stop()


@dataclass
class ProxiedS3:
    """A moto_server of the test's own, reached only through `proxy`."""

    moto: ManagedProcess
    proxy: FaultProxy
    url: str
    env: dict[str, str]


@pytest.fixture
def proxied_s3(start_moto: Callable[[], ManagedProcess]) -> Iterator[ProxiedS3]:
    moto = start_moto()
    proxy = FaultProxy(f"http://127.0.0.1:{moto.port}")
    bucket = create_bucket(proxy.url)
    yield ProxiedS3(moto, proxy, f"s3://{bucket}/picomq", s3_environment(proxy.url))
    proxy.stop()


def commit_put_records(proxy: FaultProxy, since: int = 0) -> list[Record]:
    """The proxy's records of the PUTs that hold appends, from record `since`: log objects
    (a member's flushes) and segments (a create's first, rewrites), not meta.json or
    markers."""
    return [
        record
        for record in proxy.log()[since:]
        if record.method == "PUT" and ("/seg/" in record.path or "/log/" in record.path)
    ]


def s3_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point s3fs (in PicoMQ or in a test) at `endpoint`."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }


def create_bucket(endpoint: str, prefix: str = "picomq") -> str:
    """A new, empty bucket on the S3 at `endpoint`; returns its name."""
    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    port = urlsplit(endpoint).port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("PUT", f"/{bucket}")
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status == 200, f"creating bucket {bucket}: {response.status} {body!r}"
    return bucket


@dataclass(frozen=True)
class S3Storage:
    """A fresh bucket on the session's moto: `url` for PICOMQ_STORAGE_URL, `env` for AWS."""

    endpoint: str
    bucket: str
    url: str
    env: dict[str, str]


@pytest.fixture
def s3_storage(moto_s3: str) -> S3Storage:
    bucket = create_bucket(moto_s3)
    return S3Storage(moto_s3, bucket, f"s3://{bucket}/picomq", s3_environment(moto_s3))


@pytest.fixture(params=["local", "s3"])
def storage_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A fresh storage root, once on local disk and once in a new bucket on moto S3."""
    if request.param == "local":
        return str(tmp_path / "store")
    endpoint = request.getfixturevalue("moto_s3")
    for name, value in s3_environment(endpoint).items():
        monkeypatch.setenv(name, value)
    return f"s3://{create_bucket(endpoint, 'storage')}/picomq"


def follow_stream(url: str, max_reads: int, timeout: float) -> Iterator[requests.Response]:
    """GET the stream from the start, each read on a new connection from the offset the
    read before named in Stream-Next-Offset; yield each response (asserted 200), at most
    max_reads of them."""
    offset = "-1"
    for _ in range(max_reads):
        response = requests.get(
            url,
            params={"offset": offset},
            headers={"Connection": "close"},
            timeout=timeout,
        )
        assert response.status_code == 200, (response.status_code, response.text)
        offset = response.headers["Stream-Next-Offset"]
        yield response


@pytest.fixture
def unique_stream(request: pytest.FixtureRequest) -> str:
    """A stream path no other test uses: the test's name plus a random suffix."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60].strip("-")
    return f"{name}-{uuid.uuid4().hex[:12]}"


def read_all(store: StreamStore, path: str, offset: int | None = None) -> bytes:
    """A stream of a store called directly, from `offset` to its tail, over as many reads
    as the store needs."""
    result = store.read(path, offset)
    data = b"".join(result.chunks)
    while result.end < result.info.tail:
        result = store.read(path, result.end)
        data += b"".join(result.chunks)
    return data


def soon(condition: Callable[[], object], seconds: float = 15.0) -> bool:
    """Whether `condition` holds within `seconds`, looked at as the event loop turns:
    for what a store called in process, or a child process, does in the background."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        gevent.sleep(0.02)
    return True
