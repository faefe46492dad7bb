"""Scoring text pairs, the same way for the SDK and the gateway (vLLM's score and rerank):
a cross-encoder reads each pair as one prompt, [CLS] a [SEP] b [SEP] with the second
text's token type 1; an embedding model scores a pair by its vectors' cosine."""
from __future__ import annotations

from services.invalid_parameter import InvalidParameter


def pair_lists(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one first text against each second text, or the two lists pairwise."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise InvalidParameter("text_1", "text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidParameter("text_2", f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one "
                               "text_1, or as many as text_2")
    return firsts, seconds


def pair_prompt(first: list[int], second: list[int]) -> tuple[list[int], int]:
    """Two texts each encoded with the model's special tokens ([CLS] x [SEP]) as one pair
    prompt, and where its second segment starts: BERT's own pair template."""
    return first + second[1:], len(first)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0
