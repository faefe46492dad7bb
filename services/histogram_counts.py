"""A histogram as plain numbers, for what one process observes and another exports: the
scheduler counts the tokens of each step, and the gateway's /metrics shows them, summed
over the replicas."""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec


class HistogramCounts(msgspec.Struct, frozen=True):
    counts: tuple[int, ...]  # observations per bucket (not cumulative), the +Inf bucket last
    sum: float

    @classmethod
    def zero(cls, bounds: Sequence[float]) -> HistogramCounts:
        return cls((0,) * (len(bounds) + 1), 0.0)

    def __add__(self, other: HistogramCounts) -> HistogramCounts:
        return HistogramCounts(tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
                               self.sum + other.sum)


class BucketCounter:
    """Counts observations into fixed buckets; a snapshot may go to any thread."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are `le`: a value equal to a bound belongs to that bound's bucket.
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(tuple(self._counts), self._sum)
