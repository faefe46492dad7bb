"""Suffix decoding (scheduler_svc/suffix_tree.py, scheduler_svc/suffix_proposer.py): the
trees' counts, the probability threshold, the spec factor and the depth bound the drafts,
removal uncounts exactly, and the proposer draws on the request's prompt, its own output
and ended requests' outputs, keeping at most max_cached_requests of those."""
from __future__ import annotations

import random

from scheduler_svc.request import Request
from scheduler_svc.spec_step_cost import SpecStepCosts
from scheduler_svc.suffix_proposer import SuffixProposer
from scheduler_svc.suffix_tree import SuffixTree
from services.messages import StepPlan
from services.sampling_params import SamplingParams
from services.speculative_config import parse_speculative_config


def _shape(node) -> tuple:
    return node.count, {token: _shape(child) for token, child in node.children.items()}


def test_drafts_follow_the_most_frequent_continuation_within_the_bounds() -> None:
    tree = SuffixTree(6)
    tree.extend("a", [1, 2, 3, 1, 2, 3, 1, 2, 4])
    # "1 2" occurs 3 times: followed by "3 1 2" twice; "1 2 3 1 2" by 3 once, by 4 once.
    draft = tree.speculate([9, 1, 2], max_spec_tokens=5, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft.token_ids == [3, 1, 2, 3] and abs(draft.score - (3 * 2 / 3 + 1 / 3)) < 1e-9
    # The threshold cuts the run where the estimated probability falls below it.
    assert tree.speculate([1, 2], 5, 2.0, 0.7).token_ids == []
    # At most max_spec_factor drafts per matched token, and never past the tree's depth.
    assert tree.speculate([4, 1, 2], 5, 0.5, 0.1).token_ids == [3]
    shallow = SuffixTree(4)
    shallow.extend("b", [1, 2, 3, 4, 5, 6])
    assert shallow.speculate([1, 2, 3], 5, 4.0, 0.1).token_ids == [4, 5, 6]  # "3 4 5 6" is 4 deep
    assert tree.speculate([7], 5, 1.0, 0.1).token_ids == []


def test_removal_uncounts_exactly_what_the_sequence_added() -> None:
    rng = random.Random(0)
    sequences = {i: [rng.randint(0, 4) for _ in range(rng.randint(1, 30))] for i in range(20)}
    mixed, kept = SuffixTree(5), SuffixTree(5)
    for i, tokens in sequences.items():
        for start in range(0, len(tokens), 3):  # a few tokens at a time, as outputs arrive
            mixed.extend(i, tokens[start:start + 3])
        if i % 2:
            kept.extend(i, tokens)
    for i in range(0, 20, 2):
        mixed.remove(i)
    assert _shape(mixed.root) == _shape(kept.root)


def _request(request_id: str, prompt: list[int], output: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0), (0,), output_token_ids=list(output))


def test_the_proposer_reads_the_prompt_its_output_and_ended_requests_fifo() -> None:
    spec = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8,
                                     "suffix_decoding_max_cached_requests": 1})
    proposer = SuffixProposer(spec)
    # The prompt: "5 6" was followed by "7 8".
    assert proposer.propose(_request("p", [5, 6, 7, 8, 9, 5, 6], []), 8) == [7, 8]
    # Its own output: "11 12 13" came before.
    assert proposer.propose(_request("o", [1], [11, 12, 13, 14, 11, 12]), 8) == [13, 14]
    # An ended request's output, for another request.
    ended = _request("e", [1], [21, 22, 23, 24, 25])
    proposer.propose(ended, 8)
    ended.output_token_ids += [26]
    proposer.finish(ended)
    assert proposer.propose(_request("n", [2, 21, 22, 23], []), 8) == [24, 25, 26]
    # One ended output is kept: the next one evicts it.
    for request in (_request("o", [1], [11, 12, 13, 14, 11, 12]), _request("n", [2, 21, 22, 23], [])):
        proposer.finish(request)
    assert proposer.propose(_request("m", [3, 21, 22, 23], []), 8) == []
    # With 0 kept, an output proposes only while its request runs.
    proposer = SuffixProposer(parse_speculative_config({"method": "suffix", "suffix_decoding_max_cached_requests": 0}))
    proposer.propose(ended, 8)
    proposer.finish(ended)
    assert proposer.propose(_request("n", [2, 21, 22, 23], []), 8) == []


def _decode_step(drafts: int) -> StepPlan:
    """One request's decode step verifying `drafts` drafts."""
    return StepPlan(0, num_scheduled_tokens={"r": 1 + drafts},
                    scheduled_spec_decode_tokens={"r": [7] * drafts} if drafts else {})


def test_drafts_are_cut_to_the_length_that_pays_at_the_measured_step_costs() -> None:
    costs = SpecStepCosts()
    fading = [0.5, 0.25, 0.1, 0.05]  # chance that the first 1, 2, 3, 4 drafts are all accepted
    assert costs.best_length(fading) == 4  # nothing measured yet: all of them
    costs.record(_decode_step(0), 0.010)
    costs.record(_decode_step(4), 0.020)
    costs.record(StepPlan(0, num_scheduled_tokens={"p": 100}), 0.5)  # a prompt chunk: not a decode step's cost
    # 2 to 4 rows, unmeasured, are priced as 1 (tried, then measured); 5 rows cost 2x: the 4th draft's
    # 0.05 tokens do not pay for it, 3 drafts do (1.85 tokens a decode step's time).
    assert costs.prices(6) == [0.010, 0.010, 0.010, 0.010, 0.020, 0.020]
    assert costs.best_length(fading) == 3
    costs.record(_decode_step(1), 0.016)  # 2 rows: 1.6x, which a likely draft pays and an unlikely one does not
    assert costs.best_length([0.7]) == 1 and costs.best_length([0.5]) == 0
    # A step slowed by other work costs no more than a larger step measured.
    costs.record(_decode_step(2), 0.050)
    assert costs.prices(5)[2] == 0.020


def test_the_proposer_cuts_its_draft_where_more_rows_do_not_pay() -> None:
    spec = parse_speculative_config({"method": "suffix", "suffix_decoding_max_spec_factor": 4.0})
    # "5 1" was followed by "2 3" three times of four, then by "4" twice, then "9" once.
    request = _request("c", [5, 1, 2, 3, 4, 9, 5, 1, 2, 3, 4, 8, 5, 1, 2, 3, 7, 5, 1], [])
    for row_cost, drafts in ((None, [2, 3, 4, 9]), (0.004, [2, 3]), (0.030, [])):
        costs = SpecStepCosts()
        if row_cost is not None:
            costs.record(_decode_step(0), 0.010)
            for num_drafts in range(1, 5):
                costs.record(_decode_step(num_drafts), 0.010 + row_cost * num_drafts)
        # Probabilities 3/4, 3/4, 1/2, 1/4: at 0.4 of a decode step a row, 2 drafts give the most tokens
        # a second (2.5 for 1.8x); at 3x a row, no length beats a decode step.
        assert SuffixProposer(spec, costs).propose(request, 4) == drafts
