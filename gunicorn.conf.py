"""gunicorn settings for PicoMQ: gevent workers, and timeouts that suit live reads.

A long-poll or SSE response holds its request open for up to PICOMQ_LONG_POLL_TIMEOUT
or PICOMQ_SSE_MAX_DURATION seconds; gevent workers serve thousands of such requests
per process, and both end themselves before `graceful_timeout`, so a restart lets them
finish instead of cutting them.
"""

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
