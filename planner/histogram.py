"""Quantiles of a Prometheus histogram over an interval, as PromQL's histogram_quantile
computes them: from the difference of two scrapes' cumulative buckets, interpolated
linearly inside the bucket the quantile falls in."""
from __future__ import annotations

import math
from collections.abc import Mapping


def bucket_delta(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """Each cumulative bucket's count over the interval (a bucket that shrank, its
    process restarted: counted from zero)."""
    delta = {}
    for bound, count in now.items():
        previous = before.get(bound, 0.0)
        delta[bound] = count - previous if count >= previous else count
    return delta


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative `buckets` (upper bound -> count, +Inf included);
    None when they hold no observation. A quantile in the +Inf bucket is the highest
    finite bound, as histogram_quantile answers."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
