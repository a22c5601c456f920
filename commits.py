"""Appends: validated in batches, written as one segment each, answered once durable.

The group commit. One writer per stream per process takes every pending append,
validates them in order against the stream's state (closed, content type, If-Match,
producer epoch and sequence, Stream-Seq), writes them as one segment at the tail, and
only then answers them all; appends that come meanwhile form the next batch. The
create-only write at the tail is the fence between processes and nodes: a writer that
loses reads what the winner wrote (`Pieces.catch_up`) and validates its batch again.
Processes of one machine take turns at a stream's commits (streamlocks.py) so none
starves. A plain append that finds a stream served here alone idle is a batch of one,
and commits without the batch's machinery (`Commits._commit_lone`).

Producer state travels in the segments with the data it describes, so the two never
disagree after a crash; a segment carries only the producer entries changed since the
table's last snapshot (an object of its own, written before the segment naming it).
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import random
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import gevent

from log import Record
from objectstore import StorageUnavailable
from pieces import Pieces
from rewrites import Rewrites
from segments import (
    MAX_SEGMENT_BYTES,
    POSITION_TYPE,
    ProducerEntry,
    StreamState,
    count_within,
    encode_producer_table,
    encode_segment,
)
from streams import (
    PRODUCER_ENTRY_BYTES,
    AppendRequest,
    AppendResult,
    InvalidRequest,
    Payload,
    Pending,
    PreconditionFailed,
    Producer,
    ProducerFenced,
    ProducerGap,
    StoreError,
    Stream,
    StreamClosed,
    StreamConflict,
    StreamInfo,
    StreamNotFound,
    media_type,
    segment_name,
)

if TYPE_CHECKING:
    from streamlocks import StreamLocks

log = logging.getLogger("picomq.storage")

CONTENTION_LIMIT_SECONDS = 5.0
MAX_LINGER_SECONDS = 0.05
# Idempotent producers (see `_snapshot_producers_if_due` and `_forget_producers`).
MAX_PRODUCERS = 1000
PRODUCER_IDLE_SECONDS = 7 * 24 * 3600  # as the reference server and Kafka's default
PRODUCER_CHANGES_BYTES = 16 * 1024
ENCODED_ENTRY_BYTES = 40  # an entry's quotes, brackets and numbers, besides its id
INTERRUPTED_APPEND = "the append was interrupted; it may have been written"


class Commits:
    """The writers of this process's streams."""

    def __init__(
        self,
        pieces: Pieces,
        writer_locks: StreamLocks | None,
        committed: Callable[[Stream, int, bool], None],
        rewrites: Rewrites,
    ) -> None:
        """`writer_locks` make the processes of one machine that write a stream take
        turns (streamlocks.py); without them a single process pays nothing for it.
        `committed(stream, appends, new_piece)` runs after each commit. Streams this process
        serves alone commit through the member's log, and `rewrites` holds them."""
        self.pieces = pieces
        self.objects = pieces.objects
        self.settings = pieces.settings
        self.writer_locks = writer_locks
        self.committed = committed
        self.rewrites = rewrites
        self.log = rewrites.log

    def append(self, stream: Stream, request: AppendRequest) -> AppendResult:
        """Queue an append for the stream's writer and wait until it is durable.

        An append that finds the stream without a writer commits its batch itself: a
        writer greenlet of its own would cost every lone append a turn of the event
        loop. Appends queued meanwhile get a writer greenlet. A plain one that finds it
        so through the member's log commits alone (`_commit_lone`).
        """
        if not stream.writing and self._lone(stream, request):
            stream.writing = True
            try:
                result = self._commit_lone(stream, request)
            finally:
                self._hand_on(stream)
            _readers_first(stream)
            return result
        pending = Pending(request)
        stream.pending.append(pending)
        if not stream.writing:
            stream.writing = True
            self._write_and_hand_on(stream)
            _readers_first(stream)
        return pending.result.get()

    def _write_and_hand_on(self, stream: Stream) -> None:
        """Commit the next batch; then the appends that came meanwhile get a writer."""
        try:
            logs = self._logs(stream)
            linger = self._linger(stream, logs)
            if linger:
                gevent.sleep(linger)
            if logs:  # served here alone: no other process takes turns at it
                self._take_and_commit(stream, waited=False)
            else:
                with self._writer_turn(stream) as waited:
                    self._take_and_commit(stream, waited)
        finally:
            self._hand_on(stream)

    def _hand_on(self, stream: Stream) -> None:
        """The appends that came while a commit was written get a writer greenlet."""
        if stream.pending:
            gevent.spawn(self._write_and_hand_on, stream)
        else:
            stream.writing = False

    def _lone(self, stream: Stream, request: AppendRequest) -> bool:
        """Whether an append to a stream without a writer may commit alone: data and no
        more (no producer, If-Match, Stream-Seq or close), of the stream's type, to an
        open stream served here alone that has no batch to linger for and no producer
        table to snapshot. Anything else takes the batch's way, which answers it."""
        return (
            request.payload is not None
            and request.producer is None
            and request.if_match is None
            and request.stream_seq is None
            and not request.close
            and self._logs(stream)
            and not stream.state.closed
            and _same_media_type(request.content_type, stream.config.content_type)
            and not _snapshot_may_be_due(stream.state)
            and not self._linger(stream, logs=True)
        )

    def _commit_lone(self, stream: Stream, request: AppendRequest) -> AppendResult:
        """What `_commit` does for a batch of one plain append through the member's log,
        without a plan, a state copy or a result to wait on. Over many streams nearly
        every append is such a commit, and that machinery was a good part of its cost
        (docs/shared-log.md, "Commits whose cost does not grow with the number of
        streams"). The stream's state changes in place, once its record is stored: no
        other writer runs meanwhile (`stream.writing`)."""
        payload = request.payload
        assert payload is not None  # `_lone`
        state = stream.state
        size = len(payload.data)
        record = _record(
            stream, state, state.tail, state.tail + size, payload.data,
            array(POSITION_TYPE, (size,)), array(POSITION_TYPE, _message_ends(0, payload)),
        )  # fmt: skip
        started = time.monotonic()
        new_piece = self._log(stream, record)
        state.tail = record.end
        self._written(stream, started, 1, new_piece)
        return AppendResult(stream.info())

    def _written(self, stream: Stream, started: float, appends: int, new_piece: bool) -> None:
        """After a commit's write, begun at `started`, is stored: its time (the next
        linger's measure), readers woken, listeners and counts told. `new_piece`: the
        commit may have added a piece or a producer (a lone one that joined its run did
        neither)."""
        stream.write_seconds = time.monotonic() - started
        stream.refreshed_at = started  # our write at the tail proves it was the true one
        stream.notify()
        self.committed(stream, appends, new_piece)

    def _take_and_commit(self, stream: Stream, waited: bool) -> None:
        # Taken once it is our turn: appends that came while we waited join it.
        batch, stream.pending = _take_batch(stream.pending)
        try:
            if waited:  # the process we waited for has most likely written at our tail
                self.pieces.refresh(stream, only_next=True)  # a lost create reads any more
            self._commit(stream, batch)
        except Exception as error:  # storage failed: nothing in the batch is acknowledged
            _fail_unanswered(batch, error)
        except BaseException:  # the appender committing was killed: the others must not hang
            _fail_unanswered(batch, StorageUnavailable(INTERRUPTED_APPEND))
            raise

    def _linger(self, stream: Stream, logs: bool) -> float:
        """How long a batch waits for company before it is taken: a share of the last
        write's time, so that the writers just answered send their next append into
        this batch rather than split into two cohorts taking turns (object stores bill
        per PUT). Through the log, only while that last write is recent: an idle
        stream's append goes with the log's next flush at once (and its own linger)."""
        fraction = self.settings.linger_fraction
        if not fraction:
            return 0.0
        since = time.monotonic() - (stream.refreshed_at + stream.write_seconds)
        if logs and since >= stream.write_seconds:
            return 0.0
        return min(fraction * stream.write_seconds, MAX_LINGER_SECONDS)

    def _logs(self, stream: Stream) -> bool:
        """Whether the stream commits through the member's log: it is served here alone."""
        return stream.alone and self.log.member is not None

    def _writer_turn(self, stream: Stream) -> AbstractContextManager[bool]:
        if self.writer_locks is None:
            return nullcontext(False)
        return self.writer_locks.held(stream.prefix)

    def _commit(self, stream: Stream, batch: list[Pending]) -> None:
        """Validate, write one segment, and answer: the group commit."""
        refreshed, first_loss, losses = False, 0.0, 0
        while True:
            plan = self._plan(stream, batch)
            if not plan.writes:
                if not refreshed and self.pieces.refresh(stream):
                    refreshed = True
                    continue
                break
            try:
                started = time.monotonic()
                self._write_segment(stream, plan)
            except FileExistsError:
                # Another process wrote at our tail first: adopt its state and re-validate.
                losses += 1
                first_loss = first_loss or time.monotonic()
                if time.monotonic() - first_loss > CONTENTION_LIMIT_SECONDS:
                    raise StorageUnavailable(
                        "another process keeps appending to this stream first; retry"
                    ) from None
                if losses > 2:  # spread retries out so a burst of writers interleaves
                    gevent.sleep(random.uniform(0, min(0.002 * 2**losses, 0.25)))
                self.pieces.catch_up(stream)
                refreshed = True
                continue
            except FileNotFoundError as error:  # the stream's directory was deleted under us
                raise StreamNotFound(f"stream {stream.config.path} was deleted") from error
            self._written(stream, started, len(batch), True)
            break
        _answer(batch, plan)

    def _write_segment(self, stream: Stream, plan: Plan) -> None:
        """Store the batch as the segment at the tail (through the member's log when the
        stream commits there); `FileExistsError` if another writer won the tail."""
        previous_snapshot = plan.state.producer_snapshot
        snapshot = self._snapshot_producers_if_due(stream, plan)
        if self._logs(stream):
            self._log_record(stream, plan)
        else:
            self._create_segment(stream, plan, snapshot)
        if snapshot is not None and previous_snapshot is not None:
            self.pieces.delete_later([previous_snapshot])
        if stream.state.tail == plan.start:  # else a refresh read this segment and went further
            stream.state = plan.state
            stream.last_info = plan.info  # the info after it, as its last append's answer has

    def _create_segment(self, stream: Stream, plan: Plan, snapshot: str | None) -> None:
        """Create the segment at the tail: the fence between processes that write it."""
        # A create-only write needs a token to tell its own landed attempt from another
        # writer's (a record needs none: its log object has one).
        data, index = encode_segment(
            plan.start,
            b"".join(plan.payload),
            plan.append_ends,
            plan.message_ends,
            plan.state,
            token=_new_token(),
        )
        key = stream.segment_key(plan.start)
        stream.creating = plan.start
        try:
            self.objects.create(key, data, verified_on_load=True)
        except FileExistsError:
            if self.pieces.read_piece(key, whole=True)[0].token != index.token:
                if snapshot is not None:  # written for this attempt alone: nothing names it
                    self.pieces.delete_quietly([snapshot])
                raise
            # Our own earlier attempt landed; only its answer was lost.
        finally:
            stream.creating = None
        self.pieces.cache.put(key, data)
        self.pieces.indexes.put(key, index, index.nbytes)  # live readers want it next
        stream.add_start(plan.start)

    def _log_record(self, stream: Stream, plan: Plan) -> None:
        state = plan.state
        payload = b"".join(plan.payload)
        ends = (plan.append_ends, plan.message_ends)
        self._log(stream, _record(stream, state, plan.start, state.tail, payload, *ends))

    def _log(self, stream: Stream, record: Record) -> bool:
        """Commit through the member's log: durable once the log object holding the
        record is stored (log.py); held in memory until rewritten (rewrites.py).
        Whether the record began a piece."""
        stream.raise_if_retired()  # moved while a producer snapshot was written
        # No `stream.creating`: the record goes to the log, not to a segment a watch sees.
        return self.rewrites.hold(stream, record, self.log.write(record))

    def _snapshot_producers_if_due(self, stream: Stream, plan: Plan) -> str | None:
        """Write the producer table as a snapshot once the changes since the last one
        grow past PRODUCER_CHANGES_BYTES, so no segment carries more than that (and its
        own batch's entries) however many producers the stream has had.

        The snapshot is durable before the segment that names it is written. Idle and
        surplus producers are forgotten here (`_forget_producers`). Returns the new
        snapshot's key, or None when none was due.
        """
        state = plan.state
        changed = state.producers_changed
        if not _snapshot_may_be_due(state):
            return None
        if sum(map(len, changed)) + ENCODED_ENTRY_BYTES * len(changed) <= PRODUCER_CHANGES_BYTES:
            return None
        _forget_producers(state.producers, time.time())
        key = f"{stream.prefix}/producers/{segment_name(plan.start)}-{_new_token()}"
        self.objects.create(key, encode_producer_table(state.producers))
        state.producer_snapshot, state.producers_changed = key, set()
        return key

    def _plan(self, stream: Stream, batch: list[Pending]) -> Plan:
        plan = Plan(stream.state.copy())
        for pending in batch:
            try:
                plan.outcomes.append(self._plan_one(stream, plan, pending.request))
            except StoreError as error:
                plan.outcomes.append(error)
        return plan

    def _plan_one(self, stream: Stream, plan: Plan, request: AppendRequest) -> AppendResult:
        state = plan.state
        producer = request.producer
        if state.closed:
            return self._closed_outcome(stream, state, request)
        if request.payload is not None and not _same_media_type(
            request.content_type, stream.config.content_type
        ):
            raise StreamConflict("Content-Type does not match the stream's content type")
        if request.if_match is not None:
            _check_if_match(state, request)
        if producer is not None:
            duplicate = _check_producer(state, producer)
            if duplicate is not None:
                return AppendResult(_info(stream, state), duplicate=True, producer=duplicate)
        if request.stream_seq is not None:
            if (
                state.stream_seq is not None
                and request.stream_seq.encode() <= state.stream_seq.encode()
            ):
                raise StreamConflict("Stream-Seq must increase")
            state.stream_seq = request.stream_seq
        if request.payload is not None:
            _add_payload(plan, request.payload)
        if producer is not None:
            state.producers[producer.id] = (producer.epoch, producer.seq, int(time.time()))
            state.producers_changed.add(producer.id)
        if request.close:
            state.closed = True
            state.closer = (producer.id, producer.epoch, producer.seq) if producer else None
        plan.writes = True
        plan.info = _info(stream, state)
        return AppendResult(plan.info, producer=producer)

    @staticmethod
    def _closed_outcome(stream: Stream, state: StreamState, request: AppendRequest) -> AppendResult:
        """A retried close succeeds again, if its If-Match holds; anything else is a 409."""
        producer = request.producer
        if producer is None:
            retried_close = request.payload is None and request.close
        else:
            retried_close = state.closer == (producer.id, producer.epoch, producer.seq)
        if not retried_close:
            raise StreamClosed(state.tail)
        if request.if_match is not None:
            _check_if_match(state, request)
        return AppendResult(_info(stream, state), duplicate=True, producer=producer)

    def write_first(self, stream: Stream, payload: Payload, closed: bool) -> None:
        """The segment a create writes when it has a body or closes at once."""
        plan = Plan(stream.state.copy())
        _add_payload(plan, payload)
        plan.state.closed = closed
        self._write_segment(stream, plan)


class Plan:
    """The outcome of validating one batch against the current state.

    Ends are relative to `start`, the tail the batch was planned at. A plain class:
    over many streams every append plans a batch of its own, and a dataclass's
    factories and `__post_init__` were a good part of that.
    """

    __slots__ = (
        "state", "start", "payload", "append_ends", "message_ends", "outcomes", "writes", "info",
    )  # fmt: skip

    def __init__(self, state: StreamState) -> None:
        self.state = state
        self.start = state.tail
        self.payload: list[bytes] = []
        self.append_ends = array(POSITION_TYPE)
        self.message_ends = array(POSITION_TYPE)
        self.outcomes: list[object] = []
        self.writes = False
        self.info: StreamInfo | None = None  # after its last append that writes


def _snapshot_may_be_due(state: StreamState) -> bool:
    """False when the producer entries changed since the last snapshot are surely too
    few to need one (`Commits._snapshot_producers_if_due` measures the others)."""
    return PRODUCER_ENTRY_BYTES * len(state.producers_changed) > PRODUCER_CHANGES_BYTES


def _record(
    stream: Stream,
    state: StreamState,
    start: int,
    end: int,
    payload: bytes,
    append_ends: array,
    message_ends: array,
) -> Record:
    """The record of a commit from `start` to `end`: `state` is the stream's after it
    (its tail aside, which a lone commit has yet to move)."""
    producers, changed = state.producers, state.producers_changed
    changed_entries = tuple((key, producers[key]) for key in changed) if changed else ()
    return Record(
        stream.config.path, stream.prefix, start, end, payload, append_ends, message_ends,
        state.closed, state.closer, state.stream_seq, state.producer_snapshot, changed_entries,
        time.time(),
    )  # fmt: skip


def _readers_first(stream: Stream) -> None:
    """After a commit in the appender's greenlet: the live readers just woken send
    their event before the appender's answer."""
    if stream.waiters:
        gevent.sleep(0)


def _new_token() -> str:
    """128 random bits, as uuid4 has, without its object (a measurable part of a lone
    commit: bench/README.md, "The store's figures")."""
    return os.urandom(16).hex()


def _take_batch(pending: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """The appends of the next segment (up to MAX_SEGMENT_BYTES, one at least), and the rest."""
    if len(pending) == 1:  # each commit's lot over many streams: nothing to add up
        return pending, []
    sizes = (len(p.request.payload.data) if p.request.payload else 0 for p in pending)
    taken = count_within(sizes, MAX_SEGMENT_BYTES)
    return pending[:taken], pending[taken:]


def _answer(batch: list[Pending], plan: Plan) -> None:
    """Answer each append of a batch that is durable (or wrote nothing).

    A 412 names the tail the whole batch left, not the one it was checked at: appends
    after it in the batch landed too, and a writer that retried from the older tail
    would only meet another 412.
    """
    for pending, outcome in zip(batch, plan.outcomes, strict=True):
        if isinstance(outcome, PreconditionFailed):
            outcome = PreconditionFailed(plan.state.tail, plan.state.closed)
        if isinstance(outcome, StoreError):
            pending.result.set_exception(outcome)
        else:
            pending.result.set(outcome)


def _fail_unanswered(batch: list[Pending], error: Exception) -> None:
    for pending in batch:
        if not pending.result.ready():
            pending.result.set_exception(error)


def _same_media_type(given: str | None, stream_type: str) -> bool:
    """Whether an append's Content-Type names the stream's media type; most send the very
    string the stream was created with, and need not be parsed."""
    return given == stream_type or media_type(given or "") == media_type(stream_type)


def _info(stream: Stream, state: StreamState) -> StreamInfo:
    """The stream's info at a planned state: every append's answer builds one."""
    return stream.info().at(state.tail, state.closed, stream.earliest)


def _add_payload(plan: Plan, payload: Payload) -> None:
    position = plan.state.tail - plan.start
    plan.payload.append(payload.data)
    plan.message_ends.extend(_message_ends(position, payload))
    plan.state.tail += len(payload.data)
    plan.append_ends.append(plan.state.tail - plan.start)


def _message_ends(position: int, payload: Payload) -> Iterator[int]:
    """Where the payload's messages end, placed at `position`.

    1,000 per batch, so one C-level pass. A message ends after its comma; a length plus
    one is mostly a cached small int, so the pass allocates once per message."""
    sizes = map(operator.add, payload.message_lengths, itertools.repeat(1))
    ends = itertools.accumulate(sizes, initial=position)
    next(ends)  # the start itself
    return ends


def _forget_producers(producers: dict[str, ProducerEntry], now: float) -> None:
    """Drop producers idle for PRODUCER_IDLE_SECONDS, then the longest idle beyond
    MAX_PRODUCERS: a forgotten producer starts again at sequence 0 (or gets a 409)."""
    idle = [key for key, (_, _, used) in producers.items() if used < now - PRODUCER_IDLE_SECONDS]
    for key in idle:
        del producers[key]
    if len(producers) > MAX_PRODUCERS:
        by_use = sorted(producers, key=lambda key: producers[key][2])
        for key in by_use[: len(producers) - MAX_PRODUCERS]:
            del producers[key]


def _check_if_match(state: StreamState, request: AppendRequest) -> None:
    """An If-Match, checked against the planned tail: appends earlier in the batch, and
    what a lost race at the tail brought in, count (a check before the commit would let
    two writers that saw one tail both append).

    InvalidRequest with producer headers (a producer's retry succeeds, a conditional
    append's fails: the pull request refuses the mix); PreconditionFailed when it names
    another tail (`_answer` gives it the tail the batch leaves).
    """
    if request.producer is not None:
        raise InvalidRequest("If-Match cannot be used with Producer-Id, -Epoch and -Seq")
    if request.if_match != state.tail:
        raise PreconditionFailed(state.tail, state.closed)


def _check_producer(state: StreamState, producer: Producer) -> Producer | None:
    """Validate an idempotent producer; returns the recorded (epoch, seq) on a duplicate."""
    current = state.producers.get(producer.id)
    if current is None:
        if producer.seq != 0:
            raise ProducerGap(expected=0, received=producer.seq)
        return None
    epoch, seq, _ = current
    if producer.epoch < epoch:
        raise ProducerFenced(current_epoch=epoch)
    if producer.epoch > epoch:
        if producer.seq != 0:
            raise InvalidRequest("a new Producer-Epoch must start at Producer-Seq 0")
        return None
    if producer.seq <= seq:
        return Producer(producer.id, epoch, seq)
    if producer.seq > seq + 1:
        raise ProducerGap(expected=seq + 1, received=producer.seq)
    return None
