"""gunicorn settings for PicoMQ: gevent workers, and timeouts that suit live reads.

A long-poll or SSE response holds its request open for up to PICOMQ_LONG_POLL_TIMEOUT
or PICOMQ_SSE_MAX_DURATION seconds; gevent workers serve thousands of such requests
per process, and both end themselves before `graceful_timeout`, so a restart lets them
finish instead of cutting them.
"""

import glob
import os
import shutil
import tempfile

from settings import Settings, SettingsError

try:
    # Validate in the master, before any worker forks: a typo stops the boot once, clearly.
    settings = Settings.from_environment()
except SettingsError as error:
    raise SystemExit(f"picomq: invalid setting: {error}") from None

bind = settings.bind
workers = settings.workers
worker_class = "gevent"
worker_connections = 10_000
# The gevent worker notifies the arbiter every second even while requests wait, so
# `timeout` only catches a worker whose event loop is truly stuck.
timeout = 30
graceful_timeout = 75
keepalive = 5  # short: an idle keep-alive connection delays a graceful stop
control_socket_disable = True


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
