"""Verification of draft tokens (worker_svc/runtime/sampling/rejection_sampler.py):
greedy rows give the argmax decoding would give; sampled rows follow the target
distribution exactly, checked by chi-square on a small vocabulary, where a sampler that
skips the residual (a common bug) fails the same check."""
from __future__ import annotations

import torch

from services.sampling_params import SamplingParams
from worker_svc.runtime.sampling.rejection_sampler import emitted_runs, verify

VOCAB = 6
SAMPLES = 20_000
# Chi-square with 5 degrees of freedom: p < 1e-4 past 25.7.
CRITICAL = 25.7
TEMPERATURE = 0.8
# Per verified position: the target logits, and the draft it verifies (-1: the bonus position).
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
                       [0.1, 0.9, 0.3, -0.2, 0.5, 0.0],
                       [0.0, 0.0, 1.2, 0.4, -0.3, 0.6]])
DRAFTS = [3, 0]


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def _emitted(sampler) -> list[list[int]]:
    torch.manual_seed(0)
    params = SamplingParams(temperature=TEMPERATURE)
    return sampler(LOGITS.repeat(SAMPLES, 1), [(params, DRAFTS)] * SAMPLES)


def _skips_the_residual(logits: torch.Tensor, requests: list) -> list[list[int]]:
    """Biased on purpose: accepts a draft with probability p(draft) as it should, but on a
    rejection draws from p itself instead of p without the draft."""
    probs = (logits / TEMPERATURE).softmax(-1)
    drafts = [d for _, ds in requests for d in (*ds, -1)]
    draft_probs = torch.tensor([probs[row, d] if d >= 0 else 0.0 for row, d in enumerate(drafts)])
    accepted = (torch.rand(len(drafts)) < draft_probs).tolist()
    redrawn = torch.multinomial(probs, 1).squeeze(-1).tolist()
    return emitted_runs(requests, accepted, redrawn)


def _position_statistics(emitted: list[list[int]]) -> list[float]:
    """Chi-square of each position's token against its target, among the samples whose drafts
    before it were accepted."""
    target = (LOGITS / TEMPERATURE).softmax(-1)
    first = torch.tensor([tokens[0] for tokens in emitted])
    second = torch.tensor([tokens[1] for tokens in emitted if len(tokens) > 1])
    bonus = torch.tensor([tokens[2] for tokens in emitted if len(tokens) > 2])
    return [_chi_square(first, target[0]), _chi_square(second, target[1]), _chi_square(bonus, target[2])]


def test_sampled_tokens_follow_the_target_distribution_and_a_biased_sampler_fails() -> None:
    statistics = _position_statistics(_emitted(verify))
    assert all(s < CRITICAL for s in statistics), statistics
    biased = _position_statistics(_emitted(_skips_the_residual))
    assert biased[0] > 10 * CRITICAL, biased


def test_greedy_rows_accept_the_prefix_matching_the_argmax_then_its_token() -> None:
    logits = torch.full((9, VOCAB), -1.0)
    argmax = [3, 0, 5, 2, 2, 1, 4, 4, 0]
    logits[range(9), argmax] = 1.0
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    requests = [(greedy, [3, 0, 1]),  # two accepted, the third corrected to 5
                (greedy, [2, 1]),  # all accepted, then the bonus 4
                (greedy, [1])]  # rejected at once: the argmax 4
    assert verify(logits, requests) == [[3, 0, 5], [2, 1, 4], [4]]
    # A sampled request beside them changes nothing for the greedy ones.
    mixed = verify(torch.cat([logits, logits[:2]]), [*requests, (sampled, [3])])
    assert mixed[:3] == [[3, 0, 5], [2, 1, 4], [4]] and 1 <= len(mixed[3]) <= 2
