"""Verification of draft tokens (speculative decoding), as vLLM's rejection sampler.

A request with k drafts ran k + 1 positions through the model in one step: the logits at
position i give the target distribution p_i for draft i, and the last position's give the
bonus token. Greedy rows accept the longest prefix of drafts equal to the argmax, then
emit the argmax where they first differ (or the bonus): exactly the tokens decoding one by
one would give. Sampled rows accept draft i with probability min(1, p_i(d)/q_i(d)), where
q_i is the distribution the draft was drawn from: a draft model's sampled drafts come with
it; n-gram, suffix and greedy draft-model drafts are a point mass (q_i(d) = 1), so that is
p_i(d). On the first rejection the token is drawn from the residual max(p_i - q_i, 0)
normalized (for a point mass: p_i without d), and verification stops; every emitted token
then follows p_i exactly (Leviathan et al., 2023). A seeded row draws the token plain
sampling draws at its position, with that position's noise (sampler.position_seed), and
accepts its draft when the two are equal: a seeded request emits the tokens it emits
without speculation, as greedy ones do.
"""
from __future__ import annotations

import torch

from services.sampling_params import SamplingParams
from worker_svc.runtime.sampling.sampler import SamplingBatch, argmax, draw, position_seed, probabilities

# One request's rows in the verification logits: its sampling params and its drafts.
Verified = tuple[SamplingParams, list[int]]
# A seeded request's generator, and the output position its first row samples.
Seeded = tuple[torch.Generator, int]


def verify(logits: torch.Tensor, requests: list[Verified], draft_probs: list[torch.Tensor | None] | None = None,
           seeded: list[Seeded | None] | None = None) -> list[list[int]]:
    """The tokens each request emits: its accepted drafts and one more. `logits` [R, V]
    (R = sum of drafts + 1 over the requests, in order) are adjusted as each position's
    token decoded alone would be: by the logits processors (logits_processors.
    at_each_position) and a grammar's mask (spec_grammar.py). `draft_probs`: per request,
    the distributions [drafts, V] its drafts were sampled from, or None for a point mass.
    `seeded`: per request, its generator and first row's output position where it has a seed."""
    drafts_per_row: list[int] = []  # the draft each row verifies; -1 on a request's bonus row
    for _, drafts in requests:
        drafts_per_row += [*drafts, -1]
    params = [p for p, drafts in requests for _ in range(len(drafts) + 1)]
    if all(p.greedy for p in params):
        target = argmax(logits).tolist()
        accepted = [t == d for t, d in zip(target, drafts_per_row)]
    else:
        target, accepted = _sample_rows(logits, params, drafts_per_row,
                                        _proposal_rows(requests, draft_probs or [None] * len(requests)),
                                        _seeded_rows(requests, seeded or [None] * len(requests)))
    return emitted_runs(requests, accepted, target)


def emitted_runs(requests: list[Verified], accepted: list[bool], target: list[int]) -> list[list[int]]:
    """Per request, its drafts up to the first rejected one, then that row's `target`
    token (or the bonus row's, when every draft was accepted)."""
    emitted = []
    row = 0
    for _, drafts in requests:
        tokens = []
        for i, draft in enumerate(drafts):
            if not accepted[row + i]:
                tokens.append(target[row + i])
                break
            tokens.append(draft)
        else:
            tokens.append(target[row + len(drafts)])
        emitted.append(tokens)
        row += len(drafts) + 1
    return emitted


def _seeded_rows(requests: list[Verified], seeded: list[Seeded | None]) -> list[tuple[int, torch.Generator, int]]:
    """Each sampled seeded row: (row, its request's generator, the seed of the row's position)."""
    rows = []
    row = 0
    for (params, drafts), entry in zip(requests, seeded):
        if entry is not None and not params.greedy:
            generator, position = entry
            rows += [(row + j, generator, position_seed(params.seed, position + j)) for j in range(len(drafts) + 1)]
        row += len(drafts) + 1
    return rows


def _proposal_rows(requests: list[Verified],
                   draft_probs: list[torch.Tensor | None]) -> tuple[list[int], torch.Tensor] | None:
    """The rows whose draft was sampled from a distribution, and those distributions [rows, V]."""
    rows: list[int] = []
    found: list[torch.Tensor] = []
    row = 0
    for (_, drafts), probs in zip(requests, draft_probs):
        if probs is not None:
            rows += range(row, row + len(drafts))
            found.append(probs[: len(drafts)])
        row += len(drafts) + 1
    return (rows, torch.cat(found)) if rows else None


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], drafts_per_row: list[int],
                 proposals: tuple[list[int], torch.Tensor] | None,
                 seeded: list[tuple[int, torch.Generator, int]]) -> tuple[list[int], list[bool]]:
    """Per row: the token it emits if it is the first rejected (or the bonus row), and
    whether its draft is accepted. All rows at once: a uniform and a residual draw each;
    a seeded row, plain sampling's token at its position (sampler.draw with its noise)."""
    device = logits.device
    columns = [torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)
               for name, dtype in (("temperature", torch.float32), ("top_p", torch.float32),
                                   ("top_k", torch.long), ("min_p", torch.float32))]
    batch = SamplingBatch.of(params, [None] * len(params), tuple(columns))
    probs = probabilities(logits, batch)
    drafts = torch.tensor(drafts_per_row, device=device)
    has_draft = drafts >= 0
    column = drafts.clamp(min=0)[:, None]
    draft_probs = probs.gather(-1, column).squeeze(-1)
    # q(d): 1 for a point mass; accepted with probability min(1, p(d) / q(d)).
    proposal_probs = torch.ones_like(draft_probs)
    # The residual: p without the draft for a point mass; a bonus row samples p itself.
    residual = torch.where(has_draft[:, None], probs.scatter(-1, column, 0.0), probs)
    if proposals is not None:
        rows = torch.tensor(proposals[0], device=device)
        q = proposals[1].to(device=device, dtype=probs.dtype)
        proposal_probs[rows] = q.gather(-1, column[rows]).squeeze(-1)
        residual[rows] = (probs[rows] - q).clamp(min=0)
    accepted = has_draft & (torch.rand(len(params), device=device) * proposal_probs < draft_probs)
    target = draw(residual)
    if batch.any_greedy:  # as sample(): an argmax only where a row takes it
        greedy, greedy_tokens = batch.temperature == 0, argmax(logits)
        target = torch.where(greedy, greedy_tokens, target)
        accepted = torch.where(greedy, greedy_tokens == drafts, accepted)
    for row, generator, seed in seeded:  # one at a time: each row reseeds its request's generator
        generator.manual_seed(seed)
        target[row] = draw(probs[row : row + 1], [generator])[0]
        accepted[row] = has_draft[row] & (target[row] == drafts[row])
    return target.tolist(), accepted.tolist()
