"""Verification of draft tokens (worker_svc/runtime/sampling/rejection_sampler.py):
greedy rows give the argmax decoding would give; sampled rows follow the target
distribution exactly, checked by chi-square on a small vocabulary, where a sampler that
skips the residual (a common bug) fails the same check; drafts sampled from a proposal
distribution q (a draft model's) too, where verifying them as point masses fails."""
from __future__ import annotations

import torch

from services.sampling_params import SamplingParams
from worker_svc.runtime.sampling.rejection_sampler import emitted_runs, verify
from worker_svc.runtime.sampling.sampler import SamplingBatch, position_seed, sample

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
# A draft model's distributions for the two drafts: q, unlike the target.
PROPOSAL = torch.tensor([[0.3, 1.0, 0.0, -0.4, 0.8, 0.2],
                         [1.1, -0.3, 0.6, 0.2, -0.8, 0.4]]).softmax(-1)


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


def _residual_ignores_q(logits: torch.Tensor, requests: list) -> list[list[int]]:
    """Biased on purpose: accepts with min(1, p/q) as it should, but on a rejection draws
    from p without the draft (the point mass's residual) instead of max(p - q, 0)."""
    probs = (logits / TEMPERATURE).softmax(-1)
    drafts = [d for _, ds in requests for d in (*ds, -1)]
    q = PROPOSAL.repeat(len(requests), 1)
    rows = [row for row, d in enumerate(drafts) if d >= 0]
    ratio = torch.ones(len(drafts))
    ratio[rows] = probs[rows, [drafts[r] for r in rows]] / q[torch.arange(len(rows)), [drafts[r] for r in rows]]
    accepted = [d >= 0 and u < r for d, u, r in zip(drafts, torch.rand(len(drafts)).tolist(), ratio.tolist())]
    without = probs.clone()
    without[rows, [drafts[r] for r in rows]] = 0
    return emitted_runs(requests, accepted, torch.multinomial(without, 1).squeeze(-1).tolist())


def test_drafts_sampled_from_a_proposal_follow_the_target_and_are_accepted_more() -> None:
    """A draft model's sampled drafts, verified against their q (min(1, p/q), residual
    max(p - q, 0)): the target distribution, more drafts accepted than verifying them as
    point masses (also exact: accept with p(d), residual p without d), and a residual
    that ignores q fails."""
    torch.manual_seed(0)
    drafts = torch.multinomial(PROPOSAL, SAMPLES, replacement=True).T.tolist()  # per sample, one per position
    requests = [(SamplingParams(temperature=TEMPERATURE), pair) for pair in drafts]
    logits = LOGITS.repeat(SAMPLES, 1)
    with_q = verify(logits, requests, [PROPOSAL] * SAMPLES)
    assert all(s < CRITICAL for s in _position_statistics(with_q))
    as_point_masses = verify(logits, requests)
    assert all(s < CRITICAL for s in _position_statistics(as_point_masses))
    accepted = [sum(len(tokens) > 1 for tokens in emitted) / SAMPLES for emitted in (with_q, as_point_masses)]
    assert accepted[0] > accepted[1] + 0.2, accepted
    torch.manual_seed(0)
    assert _position_statistics(_residual_ignores_q(logits, requests))[0] > 10 * CRITICAL


def test_a_seeded_request_emits_what_plain_sampling_draws_at_each_position() -> None:
    """A seeded row draws plain sampling's token at its position (that position's noise)
    and accepts its draft when they are equal: a seeded request emits without speculation's
    tokens, whatever was drafted, and an unseeded verification would not."""
    params = SamplingParams(temperature=TEMPERATURE, seed=11, top_k=4)
    first_position = 5

    def plain(position: int, row: int) -> int:
        generator = torch.Generator().manual_seed(position_seed(params.seed, position))
        columns = tuple(torch.tensor([value]) for value in (params.temperature, params.top_p, params.top_k,
                                                             params.min_p))
        return int(sample(LOGITS[row : row + 1], SamplingBatch.of([params], [generator], columns))[0])

    expected = [plain(first_position, 0), plain(first_position + 1, 1)]
    drafts = [expected[0], (expected[1] + 1) % VOCAB]  # the first as plain sampling draws it, the second not
    for _ in range(3):  # the same, every time
        generator = torch.Generator()
        assert verify(LOGITS, [(params, drafts)], seeded=[(generator, first_position)]) == [expected]
    unseeded = {tuple(verify(LOGITS, [(params, drafts)])[0]) for _ in range(50)}
    assert len(unseeded) > 1
