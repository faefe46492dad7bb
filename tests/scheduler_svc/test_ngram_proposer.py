"""Prompt lookup (scheduler_svc/ngram_proposer.py): the longest suffix n-gram that recurs,
its latest earlier occurrence, whole tokens only, and never more drafts than asked."""
from __future__ import annotations

from scheduler_svc.ngram_proposer import propose_ngram


def test_the_longest_recurring_suffix_proposes_what_followed_its_latest_occurrence() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 9, 8, 2, 3, 4, 5, 1, 2, 3]
    # [1, 2, 3] recurs at 1 (followed by 9, 8); the shorter [2, 3] recurs later, at 6 (followed by 4).
    assert propose_ngram(tokens, 2, 3, 2) == [9, 8]
    assert propose_ngram(tokens, 2, 2, 3) == [4, 5, 1]
    assert propose_ngram(tokens, 1, 3, 9) == [9, 8, 2, 3, 4, 5, 1, 2, 3]  # up to the end, never more
    assert propose_ngram(tokens, 4, 5, 3) == []  # no 4-gram recurs
    assert propose_ngram(tokens, 2, 3, 0) == []


def test_only_whole_tokens_match() -> None:
    # Packed as 4-byte ints, 256 then 0 hold the bytes of the token 1 straddling them.
    assert propose_ngram([256, 0, 5, 1], 1, 1, 2) == []
    assert propose_ngram([256, 1, 5, 1], 1, 1, 2) == [5, 1]
