"""PicoMQ's store with Flask taken out of the append path: what PicoMQ's HTTP layer costs.

bench/ceiling.py serves it exactly as PicoMQ is served. A POST to a stream goes from the
WSGI environ straight to the calls PicoMQ's view makes (`parse_payload`, then
`StreamStore.append`: group commit, fsync) and is answered 204 with its
Stream-Next-Offset. No Flask request, hooks, metrics, access line, token check or
error handling. Every other request (the load's PUTs) goes to PicoMQ's own app.
A measuring instrument, not a server: a bad request gets a stack trace.
"""

from protocol import NEXT_OFFSET, STREAM_PREFIX, format_offset
from streams import AppendRequest
from wsgi import app as picomq_app

store = picomq_app.extensions["picomq.store"]
views = picomq_app.view_functions["stream"].__self__


def app(environ, start_response):
    path = environ["PATH_INFO"]
    if environ["REQUEST_METHOD"] != "POST" or not path.startswith(STREAM_PREFIX):
        return picomq_app(environ, start_response)
    body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
    content_type = environ["CONTENT_TYPE"]
    payload = views.parse_payload(content_type, body, allow_empty=False)
    request = AppendRequest(content_type, payload, False, None, None)
    result = store.append(path.removeprefix(STREAM_PREFIX), request)
    start_response("204 No Content", [(NEXT_OFFSET, format_offset(result.info.tail))])
    return [b""]
