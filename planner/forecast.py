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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Forecast:
    window_s: float  # the samples the line is fit through: those of the last window_s
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, now_s: float, value: float) -> None:
        self.samples.append((now_s, value))
        # At least two samples are kept, a line needs them.
        while len(self.samples) > 2 and self.samples[0][0] < now_s - self.window_s:
            self.samples.popleft()

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
        """The demand `ahead_s` from the newest sample: the line's value there when it
        rises, else its value now (never below 0)."""
        level, slope = self.line()
        return max(0.0, level + max(0.0, slope) * ahead_s)
