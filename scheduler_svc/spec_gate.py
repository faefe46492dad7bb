"""When not to speculate: whole batches past vLLM's `disable_by_batch_size`, and requests
whose drafts keep being rejected (docs/speculative.md, "Knowing when not to").

A verification step of 1 + k tokens costs more than a decode step (on the CPU here, 1.35x
with 3 drafts, 1.77x with 4), and with acceptance a per draft (the chance each next draft
is accepted) it yields (1 - a^(k+1)) / (1 - a) tokens: 3 drafts pay from a ~ 0.27, 4 from
a ~ 0.45. Each request's a is estimated as a moving average (weight ALPHA per
observation) of whether its first draft was accepted, starting from the gate's prior: the
same average over every request's observations (weight PRIOR_ALPHA), itself starting
optimistic at 1. Starting each request at 1 cost a workload whose drafts all miss (output
sampled at temperature 1) about six rejected verification steps a request before it was
held back, 14-20% of its tokens/s; from the prior, such a request starts held back, and a
request of a workload whose drafts pass starts speculating. Below
MIN_ACCEPTANCE its drafts are held back: it decodes one token per step, while the
proposer still proposes (free for ngram and suffix; the worker drafts anyway for
draft_model) and each held-back first draft is compared with the token the step then
produces, so the estimate keeps moving; once it is back at MIN_ACCEPTANCE the request
speculates again. Held-back drafts are never verified and count in no metric.

A batch: with B > 1 requests running, every draft costs its share of a compute-bound step. At
the start of each step (`start_step`) the gate compares what speculating steps have
yielded, tokens a verifying request emitted (a moving average, with the drafts it
verified), against the measured cost of a step of that many rows, B (1 + drafts), over one
of B rows (scheduler_svc/spec_step_cost.py); where the tokens do not pay for the time, the
step's drafts are held back as a request's are. One step in EXPLORE_EVERY speculates all
the same, so the yield and the cost are measured again as the batch changes. On a 2-core
Xeon (benchmarks/speculative.py) it took ngram's 4 drafts at eight copy-heavy requests from
0.85-0.90x of plain decoding's tokens/s to 0.97-1.01x; at eight random-token requests,
3.6 tokens a verification, it still reads the drafts as paying, and they lose 10-16%.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.spec_step_cost import SpecStepCosts

MIN_ACCEPTANCE = 0.3
ALPHA = 0.2
PRIOR_ALPHA = 0.05
EXPLORE_EVERY = 16


@dataclass
class _Estimate:
    acceptance: float = 1.0
    held_back: int | None = None  # the first draft of the step in flight, held back


class SpecGate:
    def __init__(self, disable_by_batch_size: int | None, step_costs: SpecStepCosts | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.step_costs = step_costs
        self._estimates: dict[str, _Estimate] = {}
        self.prior = 1.0  # where a new request's estimate starts
        # Per verifying request and step, moving averages: tokens emitted and drafts verified.
        self._yield: tuple[float, float] | None = None
        self._batch_holds = False  # this step's drafts are held back: the batch would not gain
        self._steps_held = 0

    def start_step(self, num_running: int) -> None:
        """Whether this step's batch of `num_running` requests speculates (see above)."""
        self._batch_holds = not self._batch_pays(num_running) and self._steps_held + 1 < EXPLORE_EVERY
        self._steps_held = self._steps_held + 1 if self._batch_holds else 0

    def _batch_pays(self, batch: int) -> bool:
        if self.step_costs is None or self._yield is None or batch < 2:
            return True  # one request: its own acceptance decides (and suffix's cut, its drafts' length)
        tokens, drafts = self._yield
        plain, verified = self.step_costs.price(batch), self.step_costs.price(round(batch * (1 + drafts)))
        return plain is None or verified is None or tokens / verified >= 1 / plain

    def admit(self, request_id: str, drafts: list[int], num_running: int) -> list[int]:
        """The drafts to verify this step: all of them, or none."""
        if not drafts or (self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size):
            return []
        estimate = self._estimates.get(request_id)
        if estimate is None:
            estimate = self._estimates[request_id] = _Estimate(self.prior)
        if estimate.acceptance >= MIN_ACCEPTANCE and not self._batch_holds:
            return drafts
        estimate.held_back = drafts[0]
        return []

    def observe(self, request_id: str, num_drafts: int, emitted: list[int]) -> None:
        """A step's outcome for a request: `num_drafts` verified, `emitted` the tokens it produced."""
        estimate = self._estimates.get(request_id)
        if estimate is None or not emitted:
            return
        if num_drafts:
            hit = len(emitted) > 1
            step = (len(emitted), num_drafts)
            self._yield = step if self._yield is None else tuple(
                mean + ALPHA * (value - mean) for mean, value in zip(self._yield, step))
        elif estimate.held_back is not None:
            hit = emitted[0] == estimate.held_back
        else:
            return
        estimate.held_back = None
        estimate.acceptance += ALPHA * (hit - estimate.acceptance)
        self.prior += PRIOR_ALPHA * (hit - self.prior)

    def acceptance(self, request_id: str) -> float:
        estimate = self._estimates.get(request_id)
        return self.prior if estimate is None else estimate.acceptance

    def finish(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)
