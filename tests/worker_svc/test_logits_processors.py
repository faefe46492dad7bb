"""Logits processing equals transformers' logits processors on the same logits, and
temperature / top-k / top-p sample the distribution they should (chi-square)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.messages import StepPlan
from services.sampling_params import SamplingParams
from worker_svc.runtime.batch import InputBatch, RequestState
from worker_svc.runtime.sampling.logits_processors import LogitsAdjustments
from worker_svc.runtime.sampling.sampler import SamplingBatch, apply_top_k_top_p, sample

VOCAB = 64
EOS = (2,)


def state(prompt: list[int], output: list[int], **params) -> RequestState:
    return RequestState(prompt + output, len(prompt), 0, SamplingParams(**params), None)


def sampling_batch(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None
                   ) -> SamplingBatch:
    """The batch as the worker builds it: each request in a row of an InputBatch, its
    one token scheduled, the sampling columns taken from the rows that sample."""
    rows = InputBatch(1, 16, torch.device("cpu"))
    requests: dict[str, RequestState] = {}
    plan = StepPlan(step_id=0)
    for index, (row_params, generator) in enumerate(zip(params, generators or [None] * len(params))):
        requests[str(index)] = request = RequestState([0], 1, 0, row_params, generator)
        rows.add(request, [0])
        plan.num_scheduled_tokens[str(index)] = 1
    sampling = rows.prepare(plan, requests).sampling
    assert sampling is not None
    return sampling


def adjust(states: list[RequestState], logits: torch.Tensor) -> torch.Tensor:
    adjustments = LogitsAdjustments.build(states, VOCAB, EOS, torch.device("cpu"))
    return adjustments.apply(logits) if adjustments else logits


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_matches_transformers(logits):
    prompt, output = [5, 6, 7], [7, 8, 8]
    ours = adjust([state(prompt, output, repetition_penalty=1.3)] * 3, logits)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output] * 3), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_frequency_and_presence_follow_openai(logits):
    output = [9, 9, 9, 4]
    ours = adjust([state([1], output, frequency_penalty=0.5, presence_penalty=0.25)], logits[:1])
    expected = logits[:1].clone()
    expected[0, 9] -= 3 * 0.5 + 0.25
    expected[0, 4] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(ours, expected)


def test_logit_bias_matches_sequence_bias(logits):
    bias = {3: 5.0, 10: -100.0}
    ours = adjust([state([1], [], logit_bias=bias)] * 3, logits)
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1]] * 3), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_allowed_tokens_bad_words_and_min_tokens_ban_tokens(logits):
    states = [
        state([1], [], allowed_token_ids=[3, 4]),
        state([1], [20, 21], bad_words_token_ids=[[21, 22], [30], [50, 51]]),
        state([1], [20], min_tokens=3, stop_token_ids=[7]),
    ]
    out = adjust(states, logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 4]
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [22, 30]  # 51 not: 50 was not just generated
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [2, 7]  # EOS and the stop token


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (10, 0.8)])
def test_top_k_top_p_match_transformers(logits, top_k, top_p):
    ours = apply_top_k_top_p(logits, torch.tensor([top_k] * 3), torch.tensor([top_p] * 3))
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_min_p_matches_transformers(logits):
    batch = sampling_batch([SamplingParams(min_p=0.1)] * 3)
    kept = MinPLogitsWarper(0.1)(None, logits.clone())
    # Sampling never leaves the min-p set.
    for _ in range(200):
        tokens = sample(logits, batch)
        assert torch.isfinite(kept[torch.arange(3), tokens]).all()


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = len(observed) - 1
    # The chi-square survival function is the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2), statistic / 2))


def sampled_histogram(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    batch = sampling_batch([params] * draws)
    tokens = sample(logits.expand(draws, -1).contiguous(), batch)
    return torch.bincount(tokens, minlength=logits.shape[-1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.7),
    ],
)
def test_sampling_draws_the_right_distribution(params):
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    expected_logits = TemperatureLogitsWarper(params.temperature)(None, logits[None].clone())
    if params.top_k:
        expected_logits = TopKLogitsWarper(params.top_k)(None, expected_logits)
    if params.top_p < 1:
        expected_logits = TopPLogitsWarper(params.top_p)(None, expected_logits)
    expected = expected_logits.softmax(-1)[0]
    draws = 20000
    counts = sampled_histogram(logits, params, draws)
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing outside the filtered set
    assert chi_square_p_value(counts[support].double(), expected[support].double() * draws) > 1e-3


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(batch_size: int) -> int:
        generators = [torch.Generator().manual_seed(7)] + [None] * (batch_size - 1)
        batch = sampling_batch([params] + [SamplingParams()] * (batch_size - 1), generators)
        return int(sample(logits[:batch_size], batch)[0])

    assert draw(1) == draw(4)
