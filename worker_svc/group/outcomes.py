"""The leader's side of a pipeline (PP > 1): it hands plan N+1 to the stages while the
later stages still work on plan N, so each plan's outcome comes later, from the
sampling rank, in plan order. Each resolves its plan's future."""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from services.messages import StepResult
from worker_svc.group.rank_group import RankGroup

logger = logging.getLogger(__name__)


class Outcomes:
    def __init__(self, group: RankGroup) -> None:
        self._group = group
        # (the plan's future, the leader's own error in it) in plan order; None ends the thread.
        self._expected: queue.SimpleQueue[tuple[Future[StepResult], Exception | None] | None] = queue.SimpleQueue()
        self._lost: Exception | None = None
        threading.Thread(target=self._receive, name="kvfleet-outcomes", daemon=True).start()

    def expect(self, leader_error: Exception | None) -> Future[StepResult]:
        """The future of the plan just handed to the stages; `leader_error` fails it
        (once its outcome is in, so the next outcome pairs with the next plan)."""
        future: Future[StepResult] = Future()
        self._expected.put((future, leader_error))
        return future

    def close(self) -> None:
        self._expected.put(None)

    def _receive(self) -> None:
        while (expected := self._expected.get()) is not None:
            future, leader_error = expected
            if self._lost is None:
                try:
                    outcome = self._group.receive_outcome()
                except Exception as exc:  # the sampling rank is gone: so is every later outcome
                    logger.error("the worker group's outcomes stopped: %s", exc)
                    self._lost = RuntimeError(f"the worker group is down: {exc!r}")
            if leader_error is not None:  # the leader's own error first: it says what went wrong
                future.set_exception(leader_error)
            elif self._lost is not None:
                future.set_exception(self._lost)
            elif isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
