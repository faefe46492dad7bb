"""The scheduler's speculative decoding counters, with vLLM's meanings (docs/speculative.md)."""
from __future__ import annotations

from services.messages import SpecDecodingStats


class SpecDecodingCounts:
    """vLLM's speculative decoding counters: verification steps with drafts, drafts, and
    accepted drafts in all and by position (the bonus token counts in none)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos))
