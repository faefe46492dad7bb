"""Suffix decoding (scheduler_svc/suffix_tree.py, scheduler_svc/suffix_proposer.py): the
trees' counts, the probability threshold, the spec factor and the depth bound the drafts,
removal uncounts exactly, and the proposer draws on the request's prompt, its own output
and ended requests' outputs, keeping at most max_cached_requests of those."""
from __future__ import annotations

import random

from scheduler_svc.request import Request
from scheduler_svc.suffix_proposer import SuffixProposer
from scheduler_svc.suffix_tree import SuffixTree
from services.sampling_params import SamplingParams
from services.speculative_config import parse_speculative_config


def _shape(tree: SuffixTree, node: int = 0) -> tuple:
    return tree._counts[node], {token: _shape(tree, child) for token, child in tree._children[node].items()}


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
    assert _shape(mixed) == _shape(kept)
    # The removed nodes are reused: adding the sequences again takes no more nodes than the first time.
    nodes = len(mixed._counts)
    for i in range(0, 20, 2):
        mixed.extend(i, sequences[i])
    assert len(mixed._counts) == nodes


def _request(request_id: str, prompt: list[int], output: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0), (0,), output_token_ids=list(output))


def test_the_proposer_reads_the_prompt_its_output_and_ended_requests_fifo() -> None:
    spec = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8,
                                     "suffix_decoding_max_cached_requests": 1})
    proposer = SuffixProposer(spec)
    # The prompt: "5 6" was followed by "7 8".
    assert proposer.propose(_request("p", [5, 6, 7, 8, 9, 5, 6], []), 8)[0] == [7, 8]
    # Its own output: "11 12 13" came before.
    assert proposer.propose(_request("o", [1], [11, 12, 13, 14, 11, 12]), 8)[0] == [13, 14]
    # An ended request's output, for another request.
    ended = _request("e", [1], [21, 22, 23, 24, 25])
    proposer.propose(ended, 8)
    ended.output_token_ids += [26]
    proposer.finish(ended)
    assert proposer.propose(_request("n", [2, 21, 22, 23], []), 8)[0] == [24, 25, 26]
    # One ended output is kept: the next one evicts it.
    for request in (_request("o", [1], [11, 12, 13, 14, 11, 12]), _request("n", [2, 21, 22, 23], [])):
        proposer.finish(request)
    assert proposer.propose(_request("m", [3, 21, 22, 23], []), 8)[0] == []
    # With 0 kept, an output proposes only while its request runs.
    proposer = SuffixProposer(parse_speculative_config({"method": "suffix", "suffix_decoding_max_cached_requests": 0}))
    proposer.propose(ended, 8)
    proposer.finish(ended)
    assert proposer.propose(_request("n", [2, 21, 22, 23], []), 8)[0] == []


def test_the_proposer_gives_each_draft_the_chance_the_run_up_to_it_is_accepted() -> None:
    spec = parse_speculative_config({"method": "suffix", "suffix_decoding_max_spec_factor": 4.0})
    # "5 1" was followed by "2 3" three times of four, then by "4" twice, then "9" once.
    request = _request("c", [5, 1, 2, 3, 4, 9, 5, 1, 2, 3, 4, 8, 5, 1, 2, 3, 7, 5, 1], [])
    drafts, probabilities = SuffixProposer(spec).propose(request, 4)
    assert drafts == [2, 3, 4, 9] and probabilities == [0.75, 0.75, 0.5, 0.25]
