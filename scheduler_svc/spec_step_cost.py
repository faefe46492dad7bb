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
"""
from __future__ import annotations

from services.messages import StepPlan

ALPHA = 0.2  # weight of a new measurement in a row count's moving average


class SpecStepCosts:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # rows -> moving average of the worker's seconds

    def record(self, plan: StepPlan, seconds: float) -> None:
        """A step's worker time, kept when every request in it decoded (with or without drafts)."""
        rows = 0
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            if num_tokens != 1 + len(plan.scheduled_spec_decode_tokens.get(request_id, ())):
                return  # a prompt chunk: its cost says nothing about drafts
            rows += num_tokens
        if rows:
            old = self._seconds.get(rows)
            self._seconds[rows] = seconds if old is None else old + ALPHA * (seconds - old)

    def prices(self, max_rows: int) -> list[float] | None:
        """The expected seconds of a step of 1..max_rows decode rows (index rows - 1); None
        before any step is measured."""
        if not self._seconds:
            return None
        measured = sorted(self._seconds)
        envelope = {}  # rows -> the least time measured at these rows or more
        least = float("inf")
        for rows in reversed(measured):
            least = envelope[rows] = min(least, self._seconds[rows])
        prices, last = [], envelope[measured[0]]  # fewer rows than any measured: priced as those
        for rows in range(1, max_rows + 1):
            last = envelope.get(rows, last)  # unmeasured: the next smaller measured count's
            prices.append(last)
        return prices
