"""The worker's requests: each one's RequestState and its row of the persistent batch,
kept in step with the scheduler's plans (the requests a plan brings, the tokens and
blocks it adds to the others, the ones it ends), and the tokens each step computed."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.messages import StepPlan
from worker_svc.runtime.batch import InputBatch, RequestState

if TYPE_CHECKING:
    from worker_svc.runtime.sampling.grammar import Grammars


class RequestTable:
    def __init__(self, batch: InputBatch, device: torch.device, samples: bool, grammars: Callable[[], Grammars],
                 runs_adapters: bool) -> None:
        """`samples`: this rank samples, so it keeps the sampling state (seeded generators,
        grammars); `grammars` gives the worker's grammar compiler when a request needs it."""
        self.batch = batch
        self.requests: dict[str, RequestState] = {}
        self._device = device
        self._samples = samples
        self._grammars = grammars
        self._runs_adapters = runs_adapters

    def end(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted: their rows are freed."""
        for request_id in request_ids:
            if (state := self.requests.pop(request_id, None)) is not None:
                self.batch.remove(state)

    def apply(self, plan: StepPlan) -> None:
        """The requests the plan brings, and what it adds to the others'."""
        for new in plan.new_requests:
            params = new.sampling_params
            if new.lora_request is not None and not self._runs_adapters:
                raise RuntimeError(f"{new.request_id} names adapter {new.lora_request.lora_name!r}, and this worker "
                                   "runs without --enable-lora")
            seeded = self._samples and params.seed is not None
            constraint = params.structured_outputs if self._samples else None
            state = RequestState(
                list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens, params,
                torch.Generator(self._device).manual_seed(params.seed) if seeded else None,
                self._grammars().request_grammar(constraint, new.token_ids[new.num_prompt_tokens:])
                if constraint else None,
                lora_request=new.lora_request,
            )
            self.add(new.request_id, state, list(new.block_ids))
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            rejected = state.num_computed_tokens - cached.num_computed_tokens
            if 0 < rejected <= state.unverified_drafts:  # drafts the sampling rank rejected
                state.num_computed_tokens = cached.num_computed_tokens
            state.unverified_drafts = 0
            if state.num_computed_tokens != cached.num_computed_tokens:
                raise RuntimeError(
                    f"worker out of sync on {cached.request_id}: has {state.num_computed_tokens} "
                    f"computed tokens, the scheduler says {cached.num_computed_tokens}"
                )
            self.batch.append_blocks(state.row, list(cached.new_block_ids))
            state.token_ids.extend(cached.new_token_ids)
            if self._samples:
                state.num_sampled_ahead -= len(cached.new_token_ids)

    def add(self, request_id: str, state: RequestState, block_ids: list[int]) -> None:
        """A request the plan brings (again, after a preemption by recompute: its old row is freed)."""
        if (old := self.requests.pop(request_id, None)) is not None:
            self.batch.remove(old)
        self.requests[request_id] = state
        self.batch.add(state, block_ids)

    def clear(self) -> None:
        for state in self.requests.values():
            self.batch.remove(state)
        self.requests.clear()

    def count_computed(self, plan: StepPlan, emitted: dict[str, list[int]]) -> None:
        """The tokens the step computed: a verified run counts its last token and the accepted
        drafts only (the rejected drafts' KV is overwritten by the next step's tokens). A rank
        that does not sample counts every draft until the next plan says how many passed."""
        for request_id, count in plan.num_scheduled_tokens.items():
            state = self.requests[request_id]
            if drafts := plan.scheduled_spec_decode_tokens.get(request_id):
                if request_id in emitted:
                    count = len(emitted[request_id])
                elif not self._samples:
                    state.unverified_drafts = len(drafts)
            state.num_computed_tokens += count
