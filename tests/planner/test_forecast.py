"""A demand's forecast from its recent history (planner/forecast.py): no server, no clock."""
from __future__ import annotations

import pytest

from planner.forecast import Forecast


def forecast(samples: list[tuple[float, float]], window_s: float = 120.0) -> Forecast:
    series = Forecast(window_s)
    for at, value in samples:
        series.add(at, value)
    return series


def test_noise_is_averaged_where_a_two_point_change_would_multiply_it():
    # A flat 5000 with +-500 of noise, every 30 s: the change over the last interval,
    # carried 120 s ahead, would read 5500 + 4 x 1000 = 9500; the line reads 6100.
    series = forecast([(0, 4500), (30, 5500), (60, 4500), (90, 5500)])
    assert series.ahead(120) == pytest.approx(6100)


def test_a_step_in_the_newest_sample_moves_the_forecast_at_once():
    # 100 for 90 s, then 110: the line's value now 106 (0.6 of the step), 120 s on 114.
    series = forecast([(0, 100), (30, 100), (60, 100), (90, 100), (120, 110)])
    assert series.line() == pytest.approx((106, 10 / 150))
    assert series.ahead(120) == pytest.approx(114)


def test_a_fall_is_met_by_the_line_now_and_old_samples_leave_the_window():
    series = forecast([(0, 1000), (30, 800), (60, 600)], window_s=60)
    assert series.ahead(120) == pytest.approx(600)  # falling: the line's value now, not below
    series.add(200, 50)  # the others are older than 60 s; two samples are kept for a line
    assert [at for at, _ in series.samples] == [60, 200]
    assert series.ahead(120) == pytest.approx(50)


def test_with_a_season_the_forecast_is_at_least_what_came_next_one_season_ago():
    # A day of 1000 s: flat at 100, then 600 from 500 s on. The next day at 430 s the
    # line is flat at 100, but the day before, within the coming 120 s, it rose to 600.
    series = Forecast(120, season_s=1000)
    for at in range(0, 1430 + 1, 30):
        series.add(at, 600 if 500 <= at < 1000 else 100)
    assert series.ahead(120) == 600
    assert series.ahead(30) == 100  # the rise was more than 30 s on
    # Without a season, or before a season of samples, the line alone.
    assert forecast([(at, 100) for at in range(0, 1430 + 1, 30)]).ahead(120) == 100
    young = Forecast(120, season_s=1000)
    for at in range(400, 430 + 1, 30):
        young.add(at, 100)
    assert young.ahead(120) == 100
