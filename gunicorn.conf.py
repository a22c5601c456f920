"""gunicorn settings for PicoMQ: gevent workers, and timeouts that suit live reads.

A long-poll or SSE response holds its request open for up to PICOMQ_LONG_POLL_TIMEOUT
or PICOMQ_SSE_MAX_DURATION seconds; gevent workers serve thousands of such requests
per process, and both end themselves before `graceful_timeout`, so a restart lets them
finish instead of cutting them.
"""

import os

bind = os.environ.get("PICOMQ_BIND", "127.0.0.1:4437")
workers = int(os.environ.get("PICOMQ_WORKERS", "1"))
worker_class = "gevent"
worker_connections = int(os.environ.get("PICOMQ_WORKER_CONNECTIONS", "10000"))
# The gevent worker notifies the arbiter every second even while requests wait, so
# `timeout` only catches a worker whose event loop is truly stuck.
timeout = 30
graceful_timeout = 75
keepalive = 75
control_socket_disable = True
accesslog = os.environ.get("PICOMQ_ACCESS_LOG") or None
