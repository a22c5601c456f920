"""gunicorn settings for PicoMQ: gevent workers (worker.py), and timeouts that suit live reads.

A long-poll or SSE response holds its request open for up to PICOMQ_LONG_POLL_TIMEOUT
or PICOMQ_SSE_MAX_DURATION seconds; gevent workers serve thousands of such requests
per process. On SIGTERM a worker ends them at once, each with a whole answer its client
resumes from (worker.py), so a restart waits only for the requests in flight.
"""

import glob
import ipaddress
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from gunicorn.arbiter import Arbiter

from settings import Settings, SettingsError

if TYPE_CHECKING:
    from worker import PicoMQWorker

try:
    # Validate in the master, before any worker forks: a typo stops the boot once, clearly.
    settings = Settings.from_environment()
except SettingsError as error:
    raise SystemExit(f"picomq: invalid setting: {error}") from None

bind = settings.bind
workers = settings.workers
worker_class = "worker.PicoMQWorker"  # gevent pywsgi, with gunicorn's limits (worker.py)
# Above PICOMQ_MAX_LIVE_CONNECTIONS, so producers still get in when every live slot is
# taken; the process needs as many file descriptors (LimitNOFILE in deploy/).
worker_connections = settings.max_live_connections + 5_000
# The gevent worker notifies the arbiter every second even while requests wait, so
# `timeout` only catches a worker whose event loop is truly stuck.
timeout = 30
# A stop ends live reads and idle connections at once; this is the backstop for a body
# still arriving (PICOMQ_BODY_TIMEOUT) and an answer still being written.
graceful_timeout = 75
keepalive = 5  # the deadline on each request head (worker.py)
control_socket_disable = True
# Past these the worker itself answers 431, 414 or 400 (in JSON: worker.py); the app never
# sees the request.
# A request line of 8190 bytes (gunicorn's most) fits the longest stream path, percent-
# encoded, plus the read parameters and an access_token.
limit_request_line = 8190
limit_request_field_size = settings.max_header_bytes
limit_request_fields = settings.max_headers


def when_ready(server: Arbiter) -> None:
    """Warn when a server that checks no tokens listens beyond this machine."""
    exposed = [address for address in server.cfg.bind if not is_loopback(address)]
    if exposed and not settings.auth_enabled:
        server.log.warning(
            "picomq: listening on %s with access control off: anyone who can reach it may"
            " read, write and delete every stream. Set PICOMQ_JWT_SECRET or"
            " PICOMQ_JWT_PUBLIC_KEY (README: Securing a deployment).",
            ", ".join(exposed),
        )


def is_loopback(address: str) -> bool:
    """Whether a gunicorn bind address stays on this machine (a host name other than
    localhost counts as reachable: no DNS lookup decides a security warning)."""
    if address.startswith(("unix:", "fd://")):
        return True
    host = address
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# prometheus-client counts in files that all workers share (see metrics.py): the master
# names one empty directory before any worker forks, and forgets dead workers' gauges.
METRICS_DIRECTORY = "PROMETHEUS_MULTIPROC_DIR"
owned_metrics_directory: list[str] = []


def on_starting(server: object) -> None:
    directory = os.environ.get(METRICS_DIRECTORY)
    if not directory:
        directory = tempfile.mkdtemp(prefix="picomq-metrics-")
        owned_metrics_directory.append(directory)
        os.environ[METRICS_DIRECTORY] = directory
    os.makedirs(directory, exist_ok=True)
    for path in glob.glob(os.path.join(directory, "*.db")):
        os.unlink(path)  # an earlier run's counts would be added to ours


def child_exit(server: object, worker: object) -> None:
    from prometheus_client import multiprocess  # only now: the variable is set

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: object) -> None:
    for directory in owned_metrics_directory:
        shutil.rmtree(directory, ignore_errors=True)


def post_fork(server: Arbiter, worker: "PicoMQWorker") -> None:
    """In the new worker's process: stop signals are noted until its handlers are set."""
    worker.note_stops_from_now(server.SIG_QUEUE)


def post_worker_init(worker: object) -> None:
    """Let each worker write its metric updates and access lines once per turn of its
    event loop (metrics.py's TurnWrites, logs.py's AccessLog). Imported in the worker: the
    master must never import metrics."""
    import gevent

    from logs import access_log
    from metrics import get_metrics

    defer = gevent.get_hub().loop.run_callback
    get_metrics().writes.defer = defer
    access_log.defer = defer
    # The worker serves as a member once others can reach it (members.py); stopping, it
    # rewrites what its log holds and lets the others take its streams at once.
    membership = worker.wsgi.extensions["picomq.membership"]
    membership.start(worker.peer_address)
    worker.before_exit.append(worker.wsgi.extensions["picomq.store"].close)
    worker.before_exit.append(membership.leave)
