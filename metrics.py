"""Prometheus metrics, correct across several gunicorn workers.

Each worker is its own process, so each counts in its own files under one shared
directory (prometheus-client's multiprocess mode) and `/metrics` sums them. The mode
is chosen when `prometheus_client` is first imported, from PROMETHEUS_MULTIPROC_DIR,
which gunicorn.conf.py's hooks set in the master before any worker forks (and use to
forget a dead worker's live gauges); so the master never imports this module. Outside
gunicorn, without that variable, the metrics live in this process only.

Hot paths pay a dictionary lookup and a locked memory write per update; those of appends
and storage requests, the most frequent, are held until the event loop's turn ends and
written together, counters added up first (TurnWrites). Every label
value a request can reach comes from a fixed list (content types, read modes, storage
operations, HTTP statuses), so the number of series never grows with the input.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from flask import Response, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from dirwatch import Cancel, OnCreate
from objectstore import ObjectStore, run_here
from protocol import PRODUCER_EPOCH, STREAM_PREFIX, is_reserved

T = TypeVar("T")

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE_LABELS = ("application/json", "application/octet-stream", "text/plain")
LIVE_MODES = ("long-poll", "sse")
STORAGE_OPERATIONS = ("put", "get", "head", "list", "delete")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def label_of_content_type(content_type: str | None) -> str:
    """A bounded label: the common media types by name, every other one as 'other'."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in CONTENT_TYPE_LABELS:
        return media
    return "text/other" if media.startswith("text/") else "other"


class TurnWrites:
    """Metric updates held in memory and written together when the event loop's turn ends.

    Each update of a multiprocess metric takes a lock, checks the pid and writes its
    file, and a group commit makes five (the storage put's counter and latency, the
    batch size) besides two per append. A commit's appends, and the commits whose syncs
    one batch of creates shared, are answered in one turn of the loop, so under the
    gevent worker, which sets `defer` (gunicorn.conf.py), counters are added up and
    histograms' equal observations counted (a batch size of 1, over and over, when each
    append is a commit of its own, as over 1,000 streams): more appends a second there
    (figures: bench/README.md). Without `defer` every update is written at once.
    """

    def __init__(self) -> None:
        self.increments: dict[Any, float] = {}  # a counter (a labelled child) -> amount
        # (a histogram child, value) -> how many times it was observed
        self.observations: dict[tuple[Any, float], int] = {}
        self.defer: Callable[[Callable[[], None]], object] | None = None

    def inc(self, counter: Any, amount: float = 1) -> None:
        first_of_turn = not self.increments and not self.observations
        self.increments[counter] = self.increments.get(counter, 0) + amount
        self._write_when_turn_ends(first_of_turn)

    def observe(self, histogram: Any, value: float) -> None:
        first_of_turn = not self.increments and not self.observations
        key = (histogram, value)
        self.observations[key] = self.observations.get(key, 0) + 1
        self._write_when_turn_ends(first_of_turn)

    def _write_when_turn_ends(self, first_of_turn: bool) -> None:
        if self.defer is None:
            self.write()
        elif first_of_turn:
            self.defer(self.write)

    def write(self) -> None:
        increments, self.increments = self.increments, {}
        observations, self.observations = self.observations, {}
        for counter, amount in increments.items():
            counter.inc(amount)
        for (histogram, value), times in observations.items():
            observe_repeatedly(histogram, value, times)


def observe_repeatedly(histogram: Histogram, value: float, times: int) -> None:
    """What `times` calls of `histogram.observe(value)` record, in two writes.

    prometheus-client has no weighted observe, so this adds to the histogram's sum and
    bucket itself: its version is pinned, and tests/test_metrics.py checks the result
    against `observe` itself."""
    if times == 1:
        histogram.observe(value)
        return
    histogram._sum.inc(value * times)  # noqa: SLF001
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets, strict=True):  # noqa: SLF001
        if value <= bound:
            bucket.inc(times)
            return


@dataclass(frozen=True)
class Metrics:
    """Every metric PicoMQ exports; one set per process, from `get_metrics()`."""

    appends: Counter
    append_bytes: Counter
    reads: Counter
    live_connections: Gauge
    commit_batch_size: Histogram
    storage_requests: Counter
    storage_seconds: Histogram
    errors: Counter
    auth_failures: Counter
    registry: CollectorRegistry | None  # None in multiprocess mode: collected from files
    writes: TurnWrites
    append_counters: dict[str, tuple[Any, Any]]  # a content type label's two children

    def exposition(self) -> bytes:
        """The Prometheus text format, summed over every worker's files."""
        self.writes.write()
        registry = self.registry
        if registry is None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return generate_latest(registry)


@functools.cache
def get_metrics() -> Metrics:
    # Own registry in one process, so two apps in one test process never collide.
    registry = None if os.environ.get(MULTIPROCESS_VARIABLE) else CollectorRegistry()
    where: dict[str, Any] = {"namespace": "picomq", "registry": registry}
    by_type = ["content_type"]
    appends = Counter("appends", "Appends acknowledged, by content type.", by_type, **where)
    append_bytes = Counter(
        "append_bytes", "Body bytes of acknowledged appends, by content type.", by_type, **where
    )
    return Metrics(
        appends=appends,
        append_bytes=append_bytes,
        reads=Counter("reads", "Stream read requests, by mode.", ["mode"], **where),
        live_connections=Gauge(
            "live_connections",
            "Long-poll and SSE reads open now, by mode.",
            ["mode"],
            multiprocess_mode="livesum",
            **where,
        ),
        commit_batch_size=Histogram(
            "commit_batch_size",
            "Appends committed together by one group commit (one segment: one sync or PUT).",
            buckets=BATCH_BUCKETS,
            **where,
        ),
        storage_requests=Counter(
            "storage_requests", "Storage requests by operation.", ["operation"], **where
        ),
        storage_seconds=Histogram(
            "storage_seconds",
            "Latency of storage requests by operation (put on local disk includes its syncs).",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            **where,
        ),
        errors=Counter("errors", "Responses with a 4xx or 5xx status.", ["status"], **where),
        auth_failures=Counter(
            "auth_failures", "Requests refused for missing or wrong credentials.", **where
        ),
        registry=registry,
        writes=TurnWrites(),
        append_counters={},
    )


# -- requests ---------------------------------------------------------------------------


def read_mode() -> str | None:
    """'catch-up', 'long-poll' or 'sse' for a stream read; None for anything else."""
    if request.method != "GET" or not names_a_stream(request.path):
        return None
    live = request.args.get("live")
    return live if live in LIVE_MODES else "catch-up"


def is_auth_failure(response: Response) -> bool:
    status = response.status_code
    # A fenced producer's 403 carries its epoch; a 403 for a token's grants does not.
    return status == 401 or (status == 403 and PRODUCER_EPOCH not in response.headers)


def count_request_start(metrics: Metrics) -> None:
    """Before the view: count a stream read (live.LiveConnections counts those open)."""
    mode = read_mode()
    if mode is not None:
        metrics.reads.labels(mode).inc()


def count_response(metrics: Metrics, response: Response) -> None:
    """After the view: errors, auth failures, appends."""
    status = response.status_code
    if status >= 400:
        metrics.errors.labels(str(status)).inc()
        if is_auth_failure(response):
            metrics.auth_failures.inc()
    elif request.method == "POST" and names_a_stream(request.path):
        count_append(metrics, request.headers.get("Content-Type"), request.content_length or 0)


def names_a_stream(url_path: str) -> bool:
    return url_path.startswith(STREAM_PREFIX) and not is_reserved(url_path[len(STREAM_PREFIX) :])


def count_append(metrics: Metrics, content_type: str | None, size: int) -> None:
    """An append that succeeded, with a body of `size` bytes (a close alone has none)."""
    if not size:
        return
    label = label_of_content_type(content_type)
    counters = metrics.append_counters.get(label)
    if counters is None:  # labels() looks its child up by a tuple key: once per label
        counters = (metrics.appends.labels(label), metrics.append_bytes.labels(label))
        metrics.append_counters[label] = counters
    metrics.writes.inc(counters[0])
    metrics.writes.inc(counters[1], size)


def metrics_view() -> Response:
    return Response(get_metrics().exposition(), 200, {"Content-Type": CONTENT_TYPE_LATEST})


# -- storage, measured ------------------------------------------------------------------


def measured(operation: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Count and time one storage verb; failures count too (their latency matters most)."""

    def decorate(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def wrapper(self: MeasuredObjects, *args: Any, **kwargs: Any) -> T:
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.writes.inc(self.requests[operation])
                self.writes.observe(self.seconds[operation], time.perf_counter() - started)

        return wrapper

    return decorate


class MeasuredObjects(ObjectStore):
    """An object store, of either backend, each request counted and timed by operation.

    `iter_range` reads through `read`, so each chunk of a long read counts as one get.
    On local disk `put` is the whole durable create, including the wait for the batch
    it shares syncs with, so its latency is the sync latency; on S3 it is one
    conditional PUT. A `head` is counted on object stores only: on disk it is a stat,
    which every read makes and measuring would cost more than.
    """

    def __init__(self, objects: ObjectStore) -> None:
        super().__init__(run_here)
        self.objects = objects
        self.root, self.is_local = objects.root, objects.is_local
        self.links_cheaply = objects.links_cheaply
        metrics = get_metrics()
        self.writes = metrics.writes
        self.requests = {name: metrics.storage_requests.labels(name) for name in STORAGE_OPERATIONS}
        self.seconds = {name: metrics.storage_seconds.labels(name) for name in STORAGE_OPERATIONS}

    @measured("put")
    def create(self, key: str, data: bytes, *, verified_on_load: bool = False) -> None:
        self.objects.create(key, data, verified_on_load=verified_on_load)

    @measured("put")
    def link(self, source: str, key: str) -> None:
        self.objects.link(source, key)

    @measured("put")
    def touch(self, key: str) -> None:
        self.objects.touch(key)

    @measured("get")
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.objects.read(key, start, end)

    @measured("list")
    def list(self, prefix: str) -> list[str]:
        return self.objects.list(prefix)

    @measured("list")
    def list_after(self, prefix: str, after: str) -> list[str]:
        return self.objects.list_after(prefix, after)

    @measured("list")
    def list_tree(self, prefix: str) -> list[str]:
        return self.objects.list_tree(prefix)

    @measured("delete")
    def delete(self, key: str) -> None:
        self.objects.delete(key)

    @measured("delete")
    def delete_many(self, keys: list[str]) -> None:
        self.objects.delete_many(keys)

    @measured("delete")
    def delete_tree(self, prefix: str) -> None:
        self.objects.delete_tree(prefix)

    def _remove_tree(self, path: str) -> None:
        raise NotImplementedError  # delete_tree goes to the backend whole

    def identity(self, key: str) -> object | None:
        if self.is_local:
            return self.objects.identity(key)
        return self._remote_identity(key)

    def modified(self, key: str) -> float | None:
        if self.is_local:
            return self.objects.modified(key)
        return self._remote_modified(key)

    @measured("head")
    def _remote_identity(self, key: str) -> object | None:
        return self.objects.identity(key)

    @measured("head")
    def _remote_modified(self, key: str) -> float | None:
        return self.objects.modified(key)

    def exists(self, key: str) -> bool:
        return self.objects.exists(key) if self.is_local else self.identity(key) is not None

    def may_exist(self, key: str) -> bool:
        return self.objects.may_exist(key)

    def make_durable(self, key: str) -> None:
        self.objects.make_durable(key)

    def make_directory(self, prefix: str) -> None:
        self.objects.make_directory(prefix)

    def watch_creates(self, prefix: str, on_create: OnCreate) -> Cancel | None:
        return self.objects.watch_creates(prefix, on_create)
