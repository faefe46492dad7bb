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

ROOT = 0


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
    """Nodes are numbers: their counts in a list, their children (token -> node) in dicts of
    numbers, which Python's garbage collector does not follow. A tree of node objects (two
    objects a node, 24 nodes a token added) made every full collection walk the whole tree:
    100-125 ms a pass in a process holding 300,000 objects, one in every few rounds of eight
    requests, a stall every stream would see."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._counts = [0]
        self._children: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # removed nodes, for new ones
        self._tokens: dict[object, list[int]] = {}
        # Per sequence: the end nodes of its suffixes still shorter than max_depth, oldest first.
        self._open: dict[object, deque[int]] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tokens

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """Appends `tokens` to sequence `seq_id` (a new one if unknown)."""
        stored = self._tokens.setdefault(seq_id, [])
        open_ends = self._open.setdefault(seq_id, deque())
        counts, children = self._counts, self._children
        for token in tokens:
            stored.append(token)
            open_ends.append(ROOT)  # the suffix starting at this token
            for i, node in enumerate(open_ends):
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = self._new_node()
                counts[child] += 1
                open_ends[i] = child
            if len(open_ends) == self.max_depth:
                open_ends.popleft()  # its path is max_depth long: it grows no more

    def remove(self, seq_id: object) -> None:
        """Uncounts every occurrence sequence `seq_id` added."""
        tokens = self._tokens.pop(seq_id)
        del self._open[seq_id]
        counts, children = self._counts, self._children
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + self.max_depth]:
                child = children[node][token]
                counts[child] -= 1
                if counts[child] == 0:  # and the path below it, counted by this suffix only
                    del children[node][token]
                    self._free_subtree(child)
                    break
                node = child

    def speculate(self, pattern: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """The best-scoring draft continuing `pattern` (see the module's docstring)."""
        best = Draft.none()
        children = self._children
        for match_len in range(1, min(len(pattern), self.max_depth - 1) + 1):
            node = ROOT
            for token in pattern[len(pattern) - match_len:]:
                node = children[node].get(token)
                if node is None:
                    return best  # no longer match either
            limit = min(max_spec_tokens, int(max_spec_factor * match_len + 1e-6), self.max_depth - match_len)
            draft = self._follow(node, limit, min_token_prob)
            if draft.score > best.score or (draft.score == best.score and len(draft.token_ids) > len(best.token_ids)):
                best = draft
        return best

    def _follow(self, node: int, limit: int, min_token_prob: float) -> Draft:
        counts, children = self._counts, self._children
        tokens: list[int] = []
        probabilities: list[float] = []
        prob = 1.0
        while len(tokens) < limit and children[node]:
            token, child = max(children[node].items(), key=lambda item: counts[item[1]])
            prob *= counts[child] / counts[node]
            if prob < min_token_prob:
                break
            tokens.append(token)
            probabilities.append(prob)
            node = child
        return Draft(tokens, probabilities)

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self._counts.append(0)
        self._children.append({})
        return len(self._counts) - 1

    def _free_subtree(self, node: int) -> None:
        """`node` and the nodes below it, all uncounted, back to the free list."""
        pending = [node]
        while pending:
            node = pending.pop()
            pending.extend(self._children[node].values())
            self._counts[node] = 0
            self._children[node] = {}
            self._free.append(node)
