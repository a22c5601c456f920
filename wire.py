"""What PicoMQ's gunicorn worker and its app share: the JSON shape of every refusal,
and the environ keys under which the worker offers its connection and says a request
came from another member.

Light on purpose: gunicorn's master imports the worker class, and with it this module,
never the app (Flask, the store). A master that imported them left their objects to be
torn down in each worker's exit, and logging's teardown then printed a traceback.
"""

from __future__ import annotations

import orjson

# The server may offer its connection under this key (worker.py): live.py writes SSE
# events to subscribers at the tail through it, fastpath.py a plain append's answer.
DIRECT_WRITER_ENVIRON_KEY = "picomq.direct_writer"
# Set on requests that came to the peer listener (worker.py): sent on by another member
# (forwarding.py), to be served here. No header a client sends can say so.
PEER_ENVIRON_KEY = "picomq.from_peer"


def error_body(code: str, message: str, details: dict[str, object] | None = None) -> bytes:
    """The one shape of every refusal PicoMQ sends, from a view or from the worker:
    `{"error": {"code", "message", ...details}}`."""
    return orjson.dumps({"error": {"code": code, "message": message, **(details or {})}})


def code_of_reason(reason: str) -> str:
    """An error code from an HTTP reason phrase: 'Request Entity Too Large' is
    'request_entity_too_large'."""
    return reason.lower().replace(" ", "_")
