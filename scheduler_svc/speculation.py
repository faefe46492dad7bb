"""Speculative decoding's side of planning (docs/speculative.md): the drafts a decoding
request verifies in its step, from the method's proposer, held back by the gate while
they would not pay; and what decode steps cost on this machine, from which suffix
decoding cuts its drafts."""
from __future__ import annotations

from scheduler_svc.request import Request
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.spec_gate import SpecGate
from scheduler_svc.spec_proposer import make_proposer
from scheduler_svc.spec_step_cost import SpecStepCosts
from services.speculative_config import can_speculate


class Speculation:
    def __init__(self, config: SchedulerConfig) -> None:
        self.spec = config.speculative
        self.max_model_len = config.max_model_len
        self.step_costs = SpecStepCosts()
        self.proposer = make_proposer(self.spec, self.step_costs)
        self.gate = SpecGate(self.spec.disable_by_batch_size, self.step_costs)

    def propose(self, request: Request, computed: int, num_tokens: int, budget: int, num_running: int) -> list[int]:
        """Draft tokens for a decoding request to verify in this step. A request whose
        next token depends on more than its logits (processors, a grammar, a seed's
        per-position noise) decodes one token at a time, as without speculation."""
        if (num_tokens != 1 or computed + 1 != request.num_tokens or request.in_flight
                or request.sampling_params.pooling is not None):
            return []
        params = request.sampling_params
        if not can_speculate(params):
            return []
        # Never past max_tokens or the context: the drafts' positions must exist.
        k = min(self.spec.num_speculative_tokens, budget - 1, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - len(request.output_token_ids) - 1)
        if k <= 0:
            return []
        return self.gate.admit(request.request_id, self.proposer.propose(request, k), num_running)

    def start_step(self, num_running: int) -> None:
        """A step is being planned for `num_running` requests: whether its batch speculates."""
        self.gate.start_step(num_running)

    def finish(self, request: Request) -> None:
        """The request ended: the proposer and the gate forget it."""
        self.proposer.finish(request)
        self.gate.finish(request.request_id)
