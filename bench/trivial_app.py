"""The least a Flask handler can do for an append: read the body, answer 204.

bench/ceiling.py serves it exactly as PicoMQ is served, to measure what the stack
(gunicorn, its gevent worker, Flask) alone allows; gunicorn loads `bench.trivial_app:app`.
"""

from flask import Flask, request

app = Flask(__name__)


@app.post("/<path:anything>")
def append(anything: str) -> tuple[str, int]:
    request.get_data()
    return "", 204
