"""Quantiles over an interval from two scrapes of cumulative buckets (planner/histogram.py)."""
from __future__ import annotations

import math

from planner.histogram import bucket_delta, quantile


def test_the_quantile_interpolates_inside_its_bucket_as_promql_does():
    # 10 observations: 4 under 0.1, 8 under 0.5, all 10 under 1
    buckets = {0.1: 4, 0.5: 8, 1.0: 10, math.inf: 10}
    assert quantile(0.9, buckets) == 0.75  # rank 9: halfway through (0.5, 1]
    assert quantile(0.2, buckets) == 0.05
    assert quantile(0.9, {0.1: 0, math.inf: 0}) is None
    assert quantile(0.9, {0.1: 1, math.inf: 10}) == 0.1  # in +Inf: the highest finite bound


def test_the_interval_is_the_difference_of_two_scrapes_and_a_restart_counts_from_zero():
    before = {0.1: 100, 1.0: 200, math.inf: 200}
    assert bucket_delta({0.1: 100, 1.0: 210, math.inf: 220}, before) == {0.1: 0, 1.0: 10, math.inf: 20}
    assert bucket_delta({0.1: 3, 1.0: 5, math.inf: 5}, before) == {0.1: 3, 1.0: 5, math.inf: 5}
