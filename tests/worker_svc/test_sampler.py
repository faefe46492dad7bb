"""Drawing sampled tokens (worker_svc/runtime/sampling/sampler.py's `draw`, the exponential
race): tokens follow the weights (chi-square on a small vocabulary, zero weights never
drawn, weights need not sum to 1), and a seeded row draws from its own generator alone."""
from __future__ import annotations

import torch

from worker_svc.runtime.sampling.sampler import draw

SAMPLES = 50_000
CRITICAL = 25.7  # chi-square with 5 degrees of freedom: p < 1e-4 past it


def test_tokens_follow_the_weights_and_zero_weights_are_never_drawn() -> None:
    weights = torch.tensor([3.0, 0.0, 1.0, 0.5, 2.5, 0.0, 1.0])  # unnormalized, zeros inside and at the end
    torch.manual_seed(0)
    tokens = draw(weights.repeat(SAMPLES, 1))
    observed = torch.bincount(tokens, minlength=len(weights)).double()
    assert observed[1] == observed[5] == 0
    kept = weights > 0
    expected = weights[kept].double() / weights.sum() * SAMPLES
    assert float(((observed[kept] - expected) ** 2 / expected).sum()) < CRITICAL


def test_a_seeded_row_draws_from_its_own_generator() -> None:
    weights = torch.rand(3, 1000)
    def seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)
    first = draw(weights, [None, seeded(7), None])
    again = draw(weights, [None, seeded(7), seeded(8)])
    assert first[1] == again[1]
    assert len({int(draw(weights, [None, seeded(seed), None])[1]) for seed in range(20)}) > 10
