"""One demand's forecast over the replica start-up horizon, from its recent history: a
load predictor in the sense of NVIDIA Dynamo's planner (whose predictors are constant,
ARIMA, Kalman and Prophet), here a linear trend fit by least squares.

Why a fit and not the change between two observations: a demand sampled every interval
is noisy (the prompt tokens that arrived in one interval are a Poisson count of
lognormal prompts), and a two-point change carried several intervals ahead multiplies
that noise by the ratio (a 30 s change carried 120 s ahead: four times). A line through
every sample of a window as long as the horizon averages it out and still answers a
step at once: a step of D in the newest of five samples 30 s apart moves the line's
value 120 s on by 1.4 D (its value now by 0.6 D, its slope by D / 150 s).

Upward only: the forecast is never below the line's value now, so a falling load is met
by what it is, and removing replicas is left to the cooldown and the scale-down window.

With a season (a load that repeats, daily, as Dynamo's Prophet predictor models it), the
forecast is also at least the most the demand was over the coming horizon one season
ago: a change in the mix (longer answers from noon) shows no trend before it comes, and
replicas asked for when it is seen serve a start-up too late; yesterday's samples show
it a horizon ahead. Off by default: it assumes the load repeats, which only the
operator knows.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Forecast:
    window_s: float  # the samples the line is fit through: those of the last window_s
    season_s: float = 0.0  # the period the load repeats with (a day), 0 for none
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    past: deque[tuple[float, float]] = field(default_factory=deque)  # the last season's samples

    def add(self, now_s: float, value: float) -> None:
        self.samples.append((now_s, value))
        # At least two samples are kept, a line needs them.
        while len(self.samples) > 2 and self.samples[0][0] < now_s - self.window_s:
            self.samples.popleft()
        if self.season_s:
            self.past.append((now_s, value))
            while self.past[0][0] < now_s - self.season_s:
                self.past.popleft()

    def last_season(self, ahead_s: float) -> float | None:
        """The most the demand was over the coming `ahead_s`, one season ago; None while
        the samples do not reach that far back."""
        now = self.samples[-1][0]
        then = [v for t, v in self.past if t <= now - self.season_s + ahead_s]
        return max(then) if then else None

    def line(self) -> tuple[float, float]:
        """(value now, slope per second) of the least-squares line; (the sample, 0) for one."""
        now, latest = self.samples[-1]
        n = len(self.samples)
        if n == 1:
            return latest, 0.0
        mean_t = sum(t for t, _ in self.samples) / n
        mean_v = sum(v for _, v in self.samples) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self.samples)
        slope = sum((t - mean_t) * (v - mean_v) for t, v in self.samples) / spread
        return mean_v + slope * (now - mean_t), slope

    def ahead(self, ahead_s: float) -> float:
        """The demand over the next `ahead_s`: the line's value that far on when it rises,
        else its value now; with a season, at least the most it was over the same stretch
        one season ago (never below 0)."""
        level, slope = self.line()
        value = level + max(0.0, slope) * ahead_s
        seasonal = self.last_season(ahead_s) if self.season_s else None
        return max(0.0, value, seasonal or 0.0)
