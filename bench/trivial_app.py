"""The least a Flask handler can do for an append: read the body, answer 204; and the
least any WSGI callable can do, `bare`.

bench/ceiling.py serves both exactly as PicoMQ is served, to measure what the stack
(gunicorn and its worker, with and without Flask) alone allows; gunicorn loads
`bench.trivial_app:app` or `bench.trivial_app:bare`.
"""

from collections.abc import Callable, Iterable

from flask import Flask, request

app = Flask(__name__)


@app.post("/<path:anything>")
def append(anything: str) -> tuple[str, int]:
    request.get_data()
    return "", 204


def bare(environ: dict, start_response: Callable) -> Iterable[bytes]:
    environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("204 No Content", [])
    return []
