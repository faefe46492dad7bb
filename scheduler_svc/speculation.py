"""Speculative decoding's side of planning (docs/speculative.md): the drafts a decoding
request verifies in its step, from the method's proposer, held back by the gate while
they would not pay; and what decode steps cost on this machine, from which the gate cuts
drafts."""
from __future__ import annotations

from scheduler_svc.request import Request
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.spec_gate import SpecGate
from scheduler_svc.spec_proposer import make_proposer
from scheduler_svc.spec_step_cost import SpecStepCosts
from services.messages import StepPlan
from services.speculative_config import WORKER_METHODS


class Speculation:
    def __init__(self, config: SchedulerConfig) -> None:
        self.spec = config.speculative
        self.max_model_len = config.max_model_len
        self.step_costs = SpecStepCosts()
        self.proposer = make_proposer(self.spec)
        self.gate = SpecGate(self.spec.disable_by_batch_size, self.step_costs)
        self._drafts: dict[str, list[int]] = {}  # the step being planned's, by request

    def start_step(self, running: list[Request]) -> None:
        """A step is being planned for the `running` requests: each that decodes one token in
        it is proposed drafts, and the gate chooses, for the step as a whole, how many of them
        each verifies."""
        proposals = {}
        for request in running:
            if (k := self._max_drafts(request)) > 0:
                drafts, probabilities = self.proposer.propose(request, k)
                if drafts:
                    proposals[request.request_id] = drafts, probabilities
        self._drafts = self.gate.choose(proposals, len(running))

    def drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts the request verifies in the step being planned, within its token budget."""
        return self._drafts.get(request.request_id, [])[:budget - 1]

    def probes(self, plan: StepPlan) -> list[str]:
        """With a worker's draft model or EAGLE head: the plan's requests the gate holds back.
        The worker drafts only their first token after the step (what the gate judges them
        by, so that they may speculate again), not k forwards of the draft in vain."""
        if self.spec.method not in WORKER_METHODS:
            return []  # the scheduler's proposers cost next to nothing
        return [request_id for request_id in plan.num_scheduled_tokens if self.gate.holds_back(request_id)]

    @staticmethod
    def may_draft(request: Request) -> bool:
        """Whether the request may ever be given drafts: it generates (see _max_drafts)."""
        return request.sampling_params.pooling is None

    def _max_drafts(self, request: Request) -> int:
        """How many drafts the request may verify in this step: none unless it decodes one
        token (a prompt chunk, a step in flight or planned ahead, a pooling request)."""
        computed = request.num_computed_tokens + request.num_in_flight_tokens
        params = request.sampling_params
        if (computed + 1 != request.num_tokens or request.num_ahead_samples or request.in_flight
                or not self.may_draft(request)):
            return 0
        # Never past max_tokens or the context: the drafts' positions must exist.
        k = min(self.spec.num_speculative_tokens, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - len(request.output_token_ids) - 1)
        return k

    def finish(self, request: Request) -> None:
        """The request ended: the proposer and the gate forget it."""
        self.proposer.finish(request)
        self.gate.finish(request.request_id)
