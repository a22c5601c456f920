"""Metric writes held for the end of a turn record what writing each at once records."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Histogram

from metrics import BATCH_BUCKETS, TurnWrites, observe_repeatedly


def samples(histogram: Histogram) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    [metric] = histogram.collect()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


def histogram() -> Histogram:
    return Histogram("batch", "A batch size.", buckets=BATCH_BUCKETS, registry=CollectorRegistry())


@pytest.mark.parametrize("value", [0, 1, 3, 64, 0.25, 5000])
@pytest.mark.parametrize("times", [1, 2, 37])
def test_repeated_observations_record_what_observing_each_records(value: float, times: int) -> None:
    observed, repeated = histogram(), histogram()
    for _ in range(times):
        observed.observe(value)
    observe_repeatedly(repeated, value, times)
    assert samples(repeated) == samples(observed)


def test_a_turns_observations_are_written_when_it_ends() -> None:
    deferred: list[Callable[[], None]] = []
    writes = TurnWrites()
    writes.defer = deferred.append
    observed, held = histogram(), histogram()
    values = [1, 1, 2, 1, 700, 2, 1]
    for value in values:
        observed.observe(value)
        writes.observe(held, value)
    assert samples(held)[("batch_count", ())] == 0
    [write] = deferred
    write()
    assert samples(held) == samples(observed)
