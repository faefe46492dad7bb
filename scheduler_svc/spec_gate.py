"""When not to speculate, and how many drafts to verify: whole batches past vLLM's
`disable_by_batch_size`, requests whose drafts keep being rejected, and drafts whose
expected tokens do not pay for their rows in the step being planned (docs/speculative.md,
"Knowing when not to").

Requests: each request's acceptance a (the chance its first draft is accepted) is
estimated as a moving average (weight ALPHA per observation) of whether its first draft
was, starting from the gate's prior: the same average over every request's observations
(weight PRIOR_ALPHA), itself starting optimistic at 1. Starting each request at 1 cost a
workload whose drafts all miss (output sampled at temperature 1) about six rejected
verification steps a request before it was held back, 14-20% of its tokens/s; from the
prior, such a request starts held back, and a request of a workload whose drafts pass
starts speculating. Below MIN_ACCEPTANCE its drafts are held back: it decodes one token
per step, while the proposer still proposes (free for ngram and suffix; a worker's draft
model or EAGLE head drafts only the first token, StepPlan.draft_probes) and each held-back
first draft is compared with the token the step then produces, so the estimate keeps
moving; once it is back at MIN_ACCEPTANCE the request speculates again. Held-back drafts
are never verified and count in no metric.

Drafts: a verification row is not free where the weights' kernels are compute-bound (on a
2-core Xeon a step of 8 decode rows took 12 ms, of 12 rows 18), and every request in the
step waits for it. Each draft comes with the estimated chance p_j that it and the drafts
before it are all accepted: a^j from the request's acceptance a, or less where the
proposer estimates less (suffix decoding, from its trees' counts: a tree of greedy answers
is sure of continuations that a request sampling at temperature 1 follows half the time).
For each step (`choose`, with every request's proposal) the gate chooses how many of each
request's drafts to verify for the least mean time a token over the step's B requests,
time(R) / (1 + E_i) for a request verifying drafts of which E_i are expected accepted
(E_i = 0 without), R the step's rows, at the measured cost of a step's rows
(scheduler_svc/spec_step_cost.py): the mean inter-token latency its requests see. Alone
(B = 1) that is the request's own tokens per second; in a batch a draft pays for the time
it adds to every request's step, so a few requests' drafts do not slow the others', while
drafts that most of the batch would see accepted pay together. (At eight random-token
requests, where six loop and their drafts pass, speculating those six made the other two's
steps 2.3x as long: the batch, which ends with its slowest request, finished 10-16% later
than without drafts, under a rule that counted tokens a second, and 5-11% later under one
that counted the product of the requests' speed-ups.) Each next draft of a request cuts
its time a token less than the one before (its p_j do not grow), so adding drafts one at a
time, each where it cuts the most, finds the best split of each total; the best total is
then taken, whatever the shape of the costs.
"""
from __future__ import annotations

import heapq
import operator
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

from scheduler_svc.spec_proposer import Proposal
from scheduler_svc.spec_step_cost import SpecStepCosts

MIN_ACCEPTANCE = 0.3
ALPHA = 0.2
PRIOR_ALPHA = 0.05


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

    def choose(self, proposals: dict[str, Proposal], num_running: int) -> dict[str, list[int]]:
        """The drafts each request verifies in a step of `num_running` requests, from its
        proposal: a prefix, or none (held back, still judged)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return {}
        candidates = {}
        for request_id, (drafts, probabilities) in proposals.items():
            estimate = self._estimates.get(request_id)
            if estimate is None:
                estimate = self._estimates[request_id] = _Estimate(self.prior)
            estimate.held_back = drafts[0]
            if estimate.acceptance >= MIN_ACCEPTANCE:
                record = accumulate([estimate.acceptance] * len(drafts), operator.mul)
                candidates[request_id] = list(record if probabilities is None else map(min, probabilities, record))
        lengths = self._lengths(candidates, max(1, num_running))
        chosen = {}
        for request_id, length in lengths.items():
            if length:
                chosen[request_id] = proposals[request_id][0][:length]
                self._estimates[request_id].held_back = None
        return chosen

    def _lengths(self, candidates: dict[str, list[float]], requests: int) -> dict[str, int]:
        """How many drafts of each candidate to verify (see the module's docstring): all of
        them before any step is measured."""
        most = sum(map(len, candidates.values()))
        prices = None if self.step_costs is None else self.step_costs.prices(requests + most)
        if prices is None:
            return {request_id: len(probabilities) for request_id, probabilities in candidates.items()}
        lengths = dict.fromkeys(candidates, 0)
        expected = dict.fromkeys(candidates, 1.0)  # 1 + E_i
        # The next draft of each request, by how much it cuts the request's time a token (in steps).
        cuts = [(-_cut(1.0, p[0]), request_id) for request_id, p in candidates.items()]
        heapq.heapify(cuts)
        steps_a_token = float(requests)  # the sum over the step's requests of 1 / (1 + E_i)
        best_time, best_total, order = prices[requests - 1] * steps_a_token, 0, []
        while cuts:
            minus_cut, request_id = heapq.heappop(cuts)
            steps_a_token += minus_cut
            order.append(request_id)
            length = lengths[request_id] = lengths[request_id] + 1
            expected[request_id] += candidates[request_id][length - 1]
            time = prices[requests + len(order) - 1] * steps_a_token
            if time < best_time:
                best_time, best_total = time, len(order)
            if length < len(candidates[request_id]):
                heapq.heappush(cuts, (-_cut(expected[request_id], candidates[request_id][length]), request_id))
        return Counter(order[:best_total])

    def observe(self, request_id: str, num_drafts: int, emitted: list[int]) -> None:
        """A step's outcome for a request: `num_drafts` verified, `emitted` the tokens it produced."""
        estimate = self._estimates.get(request_id)
        if estimate is None or not emitted:
            return
        if num_drafts:
            hit = len(emitted) > 1
        elif estimate.held_back is not None:
            hit = emitted[0] == estimate.held_back
        else:
            return
        estimate.held_back = None
        estimate.acceptance += ALPHA * (hit - estimate.acceptance)
        self.prior += PRIOR_ALPHA * (hit - self.prior)

    def holds_back(self, request_id: str) -> bool:
        """Whether the request's drafts are held back while its estimate stays below MIN_ACCEPTANCE."""
        return self.acceptance(request_id) < MIN_ACCEPTANCE

    def acceptance(self, request_id: str) -> float:
        estimate = self._estimates.get(request_id)
        return self.prior if estimate is None else estimate.acceptance

    def finish(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)


def _cut(expected: float, probability: float) -> float:
    """How much a draft accepted with `probability` cuts a request's steps a token, 1 / (1 + E),
    from `expected` = 1 + E."""
    return 1 / expected - 1 / (expected + probability)
