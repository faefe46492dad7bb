"""Prompt lookup (vLLM's `ngram` method): draft tokens copied from the request's own
tokens. The request's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked for earlier in its prompt and output; the tokens that
followed the latest earlier occurrence are the drafts.

It runs in the scheduler, which holds every request's tokens: the drafts go to the
worker inside the step plan, so proposing and verifying take one worker step and no
extra round trip. The search is bytes.rfind over the tokens packed as 4-byte ints, in C:
a few microseconds for a context of thousands of tokens.
"""
from __future__ import annotations

from array import array


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts following the latest earlier occurrence of the longest suffix
    n-gram (min_n <= n <= max_n) of `token_ids`; [] when no suffix recurs."""
    if k <= 0 or len(token_ids) <= min_n:
        return []
    packed = array("i", token_ids).tobytes()
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * 4:]
        end = (length - 1) * 4  # an occurrence must end before the last token: not the suffix itself
        while (found := packed.rfind(pattern, 0, end)) >= 0:
            if found % 4 == 0:  # on a token boundary
                start = found // 4 + n
                return token_ids[start:start + k]
            end = found + len(pattern) - 1
    return []
