"""The scheduler's draft proposer for the configured speculative method
(docs/speculative.md): `ngram` (prompt lookup), `suffix` (suffix decoding), or
`draft_model`, `eagle` and `eagle3`, whose drafts the worker's draft model or EAGLE head
made in the step before."""
from __future__ import annotations

from typing import Protocol

from scheduler_svc.ngram_proposer import propose_ngram
from scheduler_svc.request import Request
from scheduler_svc.suffix_proposer import SuffixProposer
from services.speculative_config import WORKER_METHODS, SpeculativeConfig

# Drafts, and per draft the proposer's estimated chance that it and the drafts before it are
# all accepted (None where it has no estimate: the gate's from the request's acceptance).
Proposal = tuple[list[int], "list[float] | None"]


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> Proposal:
        """At most `k` drafts to follow the request's tokens."""

    def finish(self, request: Request) -> None:
        """The request ended (or was aborted): forget it."""


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec

    def propose(self, request: Request, k: int) -> Proposal:
        return propose_ngram(request.all_token_ids, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max, k), None

    def finish(self, request: Request) -> None:
        pass  # it keeps nothing


class DraftModelProposer:
    """The draft model's or EAGLE head's tokens from the request's last result
    (worker_svc/runtime/draft_model.py, worker_svc/runtime/eagle_drafter.py)."""

    def propose(self, request: Request, k: int) -> Proposal:
        drafts, request.draft_token_ids = request.draft_token_ids[:k], []
        return drafts, None

    def finish(self, request: Request) -> None:
        pass  # the drafts go with the request


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method in WORKER_METHODS:
        return DraftModelProposer()
    return SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)
