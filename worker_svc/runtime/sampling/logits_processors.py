"""Per-request logit adjustments, applied to the whole batch as tensor ops, in vLLM's order:
allowed tokens, bad words and min_tokens (bans), logit bias, then the repetition,
frequency and presence penalties. Each part is built only when some request in the
batch uses it, so a plain batch pays nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.sampling_params import SamplingParams
from worker_svc.runtime.batch import RequestState


@dataclass
class LogitsAdjustments:
    banned: torch.Tensor | None  # [S, V] True where a token must not be sampled
    bias: torch.Tensor | None  # [S, V] added to the logits
    # Penalties: [S] factors, output-token counts [S, V] and prompt-token presence [S, V].
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    output_counts: torch.Tensor | None
    in_prompt: torch.Tensor | None

    @classmethod
    def build(
        cls, states: list[RequestState], vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device
    ) -> LogitsAdjustments | None:
        params = [s.sampling_params for s in states]
        shape = (len(states), vocab_size)
        banned = _banned(states, shape, eos_token_ids, device)
        bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros(shape, device=device)
            for row, p in enumerate(params):
                for token, value in (p.logit_bias or {}).items():
                    bias[row, token] = value
        penalised = any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params)
        if banned is None and bias is None and not penalised:
            return None
        if not penalised:
            return cls(banned, bias, None, None, None, None, None)

        def factors(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)[:, None]

        return cls(
            banned, bias, factors("repetition_penalty"), factors("frequency_penalty"), factors("presence_penalty"),
            _token_counts([s.output_token_ids for s in states], shape, device),
            _token_counts([s.token_ids[: s.num_prompt_tokens] for s in states], shape, device) > 0,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned is not None:
            logits = logits.masked_fill(self.banned, float("-inf"))
        if self.bias is not None:
            logits = logits + self.bias
        if self.output_counts is not None:
            # Repetition (as transformers): shrink the logits of every token seen so far.
            seen = self.in_prompt | (self.output_counts > 0)
            repeated = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, repeated, logits)
            # Frequency and presence (as OpenAI): only the generated tokens count.
            logits = logits - self.frequency * self.output_counts
            logits = logits - self.presence * (self.output_counts > 0).float()
        return logits


def adjusts(p: SamplingParams) -> bool:
    """Whether a request's logits are adjusted before it samples."""
    return bool(p.allowed_token_ids is not None or p.bad_words_token_ids or p.min_tokens or p.logit_bias
                or p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty)


def at_each_position(states: list[RequestState], drafts: list[list[int]]) -> list[RequestState]:
    """Per row of a speculative verification (a request's last token, then each draft), its
    request as one-token-at-a-time decoding sees it there: the drafts before that row taken
    as output, so penalties, bans and min_tokens adjust each row as they would its token."""
    return [replace(state, token_ids=state.token_ids + row_drafts[:j])
            for state, row_drafts in zip(states, drafts) for j in range(len(row_drafts) + 1)]


def _token_counts(token_lists: list[list[int]], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    counts = torch.zeros(shape, device=device)
    rows = torch.repeat_interleave(torch.arange(shape[0], device=device),
                                   torch.tensor([len(t) for t in token_lists], device=device))
    tokens = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=device)
    counts.index_put_((rows, tokens), torch.ones(len(tokens), device=device), accumulate=True)
    return counts


def _banned(
    states: list[RequestState], shape: tuple[int, int], eos_token_ids: tuple[int, ...], device: torch.device
) -> torch.Tensor | None:
    rows: list[int] = []
    tokens: list[int] = []
    allowed_rows = []
    for row, state in enumerate(states):
        params = state.sampling_params
        output = state.output_token_ids
        if params.allowed_token_ids is not None:
            allowed_rows.append((row, params.allowed_token_ids))
        if len(output) < params.min_tokens:
            # Not allowed to stop yet: EOS and stop tokens are out of reach.
            stops = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
            rows += [row] * len(stops)
            tokens += stops
        for word in params.bad_words_token_ids:
            # A bad word's last token is banned once the tokens before it were just generated.
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix) :] == prefix:
                rows.append(row)
                tokens.append(word[-1])
    if not rows and not allowed_rows:
        return None
    banned = torch.zeros(shape, dtype=torch.bool, device=device)
    for row, allowed in allowed_rows:
        banned[row] = True
        banned[row, allowed] = False
    if rows:
        banned[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = True
    return banned
