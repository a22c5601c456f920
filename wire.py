"""What PicoMQ's gunicorn worker and its app share: the JSON shape of every refusal,
and the environ key under which the worker offers its connection.

Light on purpose: gunicorn's master imports the worker class, and with it this module,
never the app (Flask, the store). A master that imported them left their objects to be
torn down in each worker's exit, and logging's teardown then printed a traceback.
"""

from __future__ import annotations

import orjson

# The server may offer its connection under this key (worker.py): live.py writes SSE
# events to subscribers at the tail through it, fastpath.py a plain append's answer.
DIRECT_WRITER_ENVIRON_KEY = "picomq.direct_writer"


def error_body(code: str, message: str, details: dict[str, object] | None = None) -> bytes:
    """The one shape of every refusal PicoMQ sends, from a view or from the worker:
    `{"error": {"code", "message", ...details}}`."""
    return orjson.dumps({"error": {"code": code, "message": message, **(details or {})}})


def code_of_reason(reason: str) -> str:
    """An error code from an HTTP reason phrase: 'Request Entity Too Large' is
    'request_entity_too_large'."""
    return reason.lower().replace(" ", "_")
