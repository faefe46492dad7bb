"""What the next step plan tells the worker besides its requests' work: the requests
that ended or were preempted since the last plan (the worker drops their state), and
the copy-on-write copies of forked requests' partly filled blocks."""
from __future__ import annotations

from scheduler_svc.kv_handoff import KvHandoff
from scheduler_svc.request import Request
from services.messages import StepPlan


class WorkerDrops:
    def __init__(self, handoff: KvHandoff | None) -> None:
        self.handoff = handoff
        self.dropped_ids: list[str] = []
        self.copies: list[tuple[int, int]] = []

    def forget(self, request: Request) -> None:
        """The request's state on the worker goes: it ended, or was preempted."""
        if self.handoff is not None:  # a hold its prefill was growing ends with its blocks
            self.handoff.forget(request)
        if request.known_to_worker:
            request.known_to_worker = False
            self.dropped_ids.append(request.request_id)

    def take(self, plan: StepPlan) -> None:
        """Into `plan`: each drop and copy goes out once."""
        plan.finished_request_ids, self.dropped_ids = self.dropped_ids, []
        plan.blocks_to_copy, self.copies = self.copies, []
