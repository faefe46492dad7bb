"""What a draft costs on this machine: the worker's measured time of decode steps by their
rows (docs/speculative.md, "How many drafts pay").

A verification step of 1 + k rows is not free where the weights' kernels are
compute-bound: on the 2-core AVX2 CPU here a step of 4 rows cost ~1.3x a 1-row step, of 8
rows ~1.9x, of 13 rows ~3.2x. The gate (scheduler_svc/spec_gate.py) cuts each request's
drafts to the length that pays at these prices.

Times come from the steps the scheduler's plans take (`record`, every step that only
decodes: each request's last token plus its drafts), a moving average per row count. A
row count never measured is priced as the next smaller one measured (optimistic, so it is
tried and then measured; one below every measured count as the smallest); since a step of
more rows never costs less, a measurement above a larger row count's (a step slowed by the
machine's other load) is read as that one.

A row count's price is forgotten once no step of that many rows or more has been measured
for STALE_S, and the count is priced as unmeasured again: a price too high to pay is never
measured again otherwise. Batches measured while the machine was busy had priced every
draft of a lone request out for good: it decoded one token a step, whose 1-row steps were
all it measured from then on. (A batch's steps, of many row counts, keep the counts below
their own: those are capped by the envelope above anyway, and dropping them only made the
gate try them again.)
"""
from __future__ import annotations

import time

from services.messages import StepPlan

ALPHA = 0.2  # weight of a new measurement in a row count's moving average
# Against one exploratory step a second, at most, for a row count that does not pay.
STALE_S = 1.0


class SpecStepCosts:
    def __init__(self) -> None:
        # rows -> the moving average of the worker's seconds, and when it was last measured (monotonic)
        self._seconds: dict[int, tuple[float, float]] = {}

    def record(self, plan: StepPlan, seconds: float) -> None:
        """A step's worker time, kept when every request in it decoded (with or without drafts)."""
        rows = 0
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            if num_tokens != 1 + len(plan.scheduled_spec_decode_tokens.get(request_id, ())):
                return  # a prompt chunk: its cost says nothing about drafts
            rows += num_tokens
        if rows:
            now = time.monotonic()
            old, at = self._seconds.get(rows, (seconds, now))
            self._seconds[rows] = (old + ALPHA * (seconds - old) if now - at <= STALE_S else seconds), now

    def prices(self, max_rows: int) -> list[float] | None:
        """The expected seconds of a step of 1..max_rows decode rows (index rows - 1); None
        while no step has been measured in the last STALE_S."""
        envelope = self._envelope(time.monotonic())
        if not envelope:
            return None
        prices, last = [], envelope[min(envelope)]  # fewer rows than any measured: priced as those
        for rows in range(1, max_rows + 1):
            last = envelope.get(rows, last)  # unmeasured: the next smaller measured count's
            prices.append(last)
        return prices

    def _envelope(self, now: float) -> dict[int, float]:
        """Rows -> the least time measured at these rows or more, for the row counts that a
        step of as many rows or more was measured at in the last STALE_S. Walked from the
        most rows down, the stale counts come first: the envelope holds only fresh times."""
        envelope: dict[int, float] = {}
        newest, least = float("-inf"), float("inf")
        for rows in sorted(self._seconds, reverse=True):
            seconds, at = self._seconds[rows]
            newest = max(newest, at)
            if now - newest <= STALE_S:
                least = envelope[rows] = min(least, seconds)
        return envelope
