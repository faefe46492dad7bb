"""The plans handed to the worker whose results are still to come, oldest first: a
pipelined group's (one a stage), or async scheduling's plan ahead; and, under async
scheduling, each plan's worker time, which speculative decoding prices drafts by
(scheduler_svc/spec_step_cost.py)."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from services.messages import StepPlan, StepResult


@dataclass
class PlanInFlight:
    plan: StepPlan
    result: Future[StepResult]
    submitted: float
    ended: float | None = None  # when the worker's result came (set on the thread that set it)


class PlansInFlight:
    def __init__(self, timed: bool) -> None:
        """`timed`: the worker runs the plans one after another (async scheduling), so each
        plan's time is from its submission, or the end of the plan before it if later, to
        its own end. A pipeline's stages overlap: its plans are not timed."""
        self._timed = timed
        self._plans: deque[PlanInFlight] = deque()
        self._last_end = 0.0

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, plan: StepPlan, result: Future[StepResult]) -> None:
        entry = PlanInFlight(plan, result, time.perf_counter())
        if self._timed:
            result.add_done_callback(lambda _: setattr(entry, "ended", time.perf_counter()))
        self._plans.append(entry)

    def take(self) -> PlanInFlight:
        """The oldest plan (its result may still be on its way)."""
        return self._plans.popleft()

    def clear(self) -> None:
        self._plans.clear()

    def worker_seconds(self, entry: PlanInFlight) -> float | None:
        """How long the worker ran `entry`'s plan, once its result is in; None untimed."""
        if not self._timed:
            return None
        ended = entry.ended or time.perf_counter()  # its callback may run just after result() returns
        seconds = ended - max(entry.submitted, self._last_end)
        self._last_end = ended
        return seconds
