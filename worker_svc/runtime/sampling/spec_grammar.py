"""Structured outputs under speculative decoding: each draft is checked against the request's
grammar before it is verified, as vLLM does.

A request's matcher walks its drafts: at each position the grammar's mask of allowed next
tokens is taken, and the walk stops at the first draft the grammar refuses (that draft and
the ones after it are dropped: rejected without verifying). The matcher is then rolled
back, and the kept positions' logits are masked, each by the mask of its own position,
so the verification accepts a draft or draws the replacement (or the bonus token) among
allowed tokens only: exactly the tokens one-at-a-time decoding under the grammar gives.
The emitted tokens then advance the matcher as sampled tokens do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from worker_svc.runtime.batch import RequestState
    from worker_svc.runtime.sampling.grammar import Grammars


Drafts = list[tuple[str, list[int]]]  # per request given drafts: its id and its drafts


def constrain_drafts(spec_requests: Drafts, states: list[RequestState], logits: torch.Tensor,
                     vocab_size: int) -> tuple[Drafts, torch.Tensor, torch.Tensor]:
    """The drafts each grammar allows, and the rows of their positions: raw (for logprobs)
    and masked by each position's grammar state (to verify). Requests without a grammar
    keep their drafts and rows."""
    kept_requests, rows, masks = [], [], []
    first_row = 0
    for (request_id, drafts), state in zip(spec_requests, states):
        grammar = state.grammar
        kept = drafts
        if grammar is not None and grammar.waiting_for:
            kept = []  # still in its reasoning: the grammar starts at a marker a draft may hold
        elif grammar is not None and grammar.constrains:
            bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab_size)
            count = 0
            matcher = grammar.matcher
            while True:
                matcher.fill_next_token_bitmask(bitmask, count)
                if count == len(drafts) or not matcher.accept_token(drafts[count]):
                    break
                count += 1
                if matcher.is_terminated():  # a stop token: nothing follows it
                    break
            matcher.rollback(count)
            kept = drafts[:count]
            masks.append((len(rows), bitmask[: count + 1]))
        kept_requests.append((request_id, kept))
        rows += range(first_row, first_row + len(kept) + 1)
        first_row += len(drafts) + 1
    raw = logits[torch.tensor(rows, device=logits.device)] if first_row != len(rows) else logits
    masked = raw.clone()
    for start, bitmask in masks:
        xgr.apply_token_bitmask_inplace(masked[start : start + len(bitmask)], bitmask.to(logits.device),
                                        vocab_size=vocab_size)
    return kept_requests, raw, masked


def advance(grammars: Grammars, states: list[RequestState], emitted: list[list[int]]) -> None:
    """Each grammar past its request's emitted tokens, in order."""
    for state, tokens in zip(states, emitted):
        if state.grammar is not None:
            for token in tokens:
                grammars.accept([state.grammar], [token])
