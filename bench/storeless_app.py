"""PicoMQ with its store's appends answered at once: what an append costs before storage.

bench/ceiling.py serves it exactly as PicoMQ is served. Every request goes through
PicoMQ's own app (the fast path or Flask, the hooks, metrics and access line), but
`StreamStore.append` answers at once with the stream's state as it was first read and
stores nothing. Over 1,000 streams its appends/s are the most PicoMQ could take with a
store that cost nothing. A measuring instrument, not a server: appends are not kept.
"""

from storage import StreamStore
from streams import AppendRequest, AppendResult, StreamInfo
from wsgi import app

store: StreamStore = app.extensions["picomq.store"]
first_read: dict[str, StreamInfo] = {}


def answer_at_once(path: str, request: AppendRequest) -> AppendResult:
    info = first_read.get(path)
    if info is None:
        info = first_read[path] = store.head(path)
    return AppendResult(info)


store.append = answer_at_once
