"""A depth-limited suffix tree with counts, the structure suffix decoding proposes from
(Oliaro et al., "SuffixDecoding", arXiv 2411.04975; vLLM's `suffix` method).

Every substring of at most `max_depth` tokens of the sequences added is a path from the
root, and each node counts the substring's occurrences. A sequence grows a token at a
time: the token extends the paths of the (at most max_depth) suffixes still shorter than
the depth, so appending costs O(max_depth) whatever the sequence's length. A sequence can
be removed again (its occurrences uncounted, empty nodes dropped): the global tree keeps
only the latest requests' outputs.

Proposing: the pattern (the request's last tokens) is matched at every length m; from the
node it ends at, the drafts follow the most frequent child while the estimated
probability (the product of child count / parent count along the path) stays at or above
`min_token_prob`, for at most max_spec_factor * m tokens and never past the depth. The
score of a draft is the sum of its tokens' probabilities (its expected accepted length);
the best-scoring match length wins.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    # Per draft, the estimated probability that it and the drafts before it are all accepted.
    probabilities: list[float]

    @property
    def score(self) -> float:
        """The draft's expected accepted length."""
        return sum(self.probabilities)

    @staticmethod
    def none() -> Draft:
        return Draft([], [])


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._tokens: dict[object, list[int]] = {}
        # Per sequence: the end nodes of its suffixes still shorter than max_depth, oldest first.
        self._open: dict[object, deque[_Node]] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tokens

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """Appends `tokens` to sequence `seq_id` (a new one if unknown)."""
        stored = self._tokens.setdefault(seq_id, [])
        open_ends = self._open.setdefault(seq_id, deque())
        for token in tokens:
            stored.append(token)
            open_ends.append(self.root)  # the suffix starting at this token
            for i, node in enumerate(open_ends):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                open_ends[i] = child
            if len(open_ends) == self.max_depth:
                open_ends.popleft()  # its path is max_depth long: it grows no more

    def remove(self, seq_id: object) -> None:
        """Uncounts every occurrence sequence `seq_id` added."""
        tokens = self._tokens.pop(seq_id)
        del self._open[seq_id]
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # and the path below it, counted by this suffix only
                    break
                node = child

    def speculate(self, pattern: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """The best-scoring draft continuing `pattern` (see the module's docstring)."""
        best = Draft.none()
        for match_len in range(1, min(len(pattern), self.max_depth - 1) + 1):
            node = self.root
            for token in pattern[len(pattern) - match_len:]:
                node = node.children.get(token)
                if node is None:
                    return best  # no longer match either
            limit = min(max_spec_tokens, int(max_spec_factor * match_len + 1e-6), self.max_depth - match_len)
            draft = _follow(node, limit, min_token_prob)
            if draft.score > best.score or (draft.score == best.score and len(draft.token_ids) > len(best.token_ids)):
                best = draft
        return best


def _follow(node: _Node, limit: int, min_token_prob: float) -> Draft:
    tokens: list[int] = []
    probabilities: list[float] = []
    prob = 1.0
    while len(tokens) < limit and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(token)
        probabilities.append(prob)
        node = child
    return Draft(tokens, probabilities)
