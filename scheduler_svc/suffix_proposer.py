"""Suffix decoding (vLLM's `suffix` method): drafts from suffix trees over the request's
prompt and over the outputs of running and recent requests, no model.

Each request gets a tree of its prompt when it first speculates; its output tokens join
the global tree as they come, so both its own repetitions and the outputs of other
requests (agentic loops, repeated answers) propose. Its last token joins one step late:
until the next one follows it, it predicts nothing, and in the tree it would match every
pattern (which ends with it) at full length, making each proposal walk every length and
counting an occurrence with no continuation into the probabilities. When it ends, its
output stays in the global tree for the next requests; past `max_cached_requests` the
oldest output is removed (0: outputs are kept only while their request runs). The pattern is the
request's last `max_tree_depth` tokens; of the prompt tree's and the global tree's
drafts, the one with the higher score (expected accepted tokens) is proposed, with its
tokens' estimated probabilities, from which the gate cuts it to the length that pays in
its step (scheduler_svc/spec_gate.py).

It runs in the scheduler, beside the ngram proposer and for the same reason (it holds the
tokens; drafts travel in the step plan).
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler_svc.request import Request
from scheduler_svc.suffix_tree import SuffixTree
from services.speculative_config import SpeculativeConfig


class SuffixProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.global_tree = SuffixTree(spec.suffix_decoding_max_tree_depth)
        # Running requests: the tree of their prompt, and how many output tokens the global tree has.
        self._active: dict[str, tuple[SuffixTree, int]] = {}
        self._cached: OrderedDict[str, None] = OrderedDict()  # ended requests in the global tree, oldest first

    def propose(self, request: Request, k: int) -> tuple[list[int], list[float]]:
        request_id = request.request_id
        if request_id not in self._active:
            if request_id in self._cached:  # an id used again: its old output goes
                del self._cached[request_id]
                self.global_tree.remove(request_id)
            prompt_tree = SuffixTree(self.spec.suffix_decoding_max_tree_depth)
            prompt_tree.extend(request_id, request.prompt_token_ids)
            self._active[request_id] = (prompt_tree, 0)
        prompt_tree = self._sync(request)
        depth = self.spec.suffix_decoding_max_tree_depth
        pattern = request.all_token_ids[-depth:]
        args = (k, self.spec.suffix_decoding_max_spec_factor, self.spec.suffix_decoding_min_token_prob)
        drafts = max(prompt_tree.speculate(pattern, *args), self.global_tree.speculate(pattern, *args),
                     key=lambda draft: draft.score)
        return drafts.token_ids, drafts.probabilities

    def finish(self, request: Request) -> None:
        """The request ended: its whole output stays in the global tree (FIFO-bounded)."""
        request_id = request.request_id
        if request_id not in self._active:
            return
        self._sync(request, ended=True)
        del self._active[request_id]
        if request_id not in self.global_tree:
            return
        self._cached[request_id] = None
        while len(self._cached) > self.spec.suffix_decoding_max_cached_requests:
            oldest, _ = self._cached.popitem(last=False)
            self.global_tree.remove(oldest)

    def _sync(self, request: Request, ended: bool = False) -> SuffixTree:
        """Adds the request's output tokens the global tree lacks, but for the last one while it
        runs; its prompt tree."""
        prompt_tree, num_added = self._active[request.request_id]
        new = request.output_token_ids[num_added:None if ended else -1]
        if new:
            self.global_tree.extend(request.request_id, new)
            self._active[request.request_id] = (prompt_tree, num_added + len(new))
        return prompt_tree
