"""What a step returns from the rank that samples: its tokens, drawn from the logits
after the logits processors and any grammar's mask; their logprobs, of the raw logits
as vLLM reports them; and the prompt logprobs asked for. Each sampled token is also
written to the persistent batch on the device, where a step planned ahead reads it."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.messages import StepPlan, StepResult
from worker_svc.formats.model_config import ModelConfig
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.runtime.batch import InputBatch, RequestState, StepInputs
from worker_svc.runtime.sampling.logits_processors import LogitsAdjustments, adjusts, at_each_position
from worker_svc.runtime.sampling.rejection_sampler import verify
from worker_svc.runtime.sampling.sampler import gather_logprobs, position_seed, sample
from worker_svc.runtime.sampling.spec_grammar import advance, constrain_drafts

if TYPE_CHECKING:
    from worker_svc.runtime.sampling.grammar import Grammars

# A request's prompt logits this step: (request id, logits, the tokens they score, top-k wanted).
PromptLogits = tuple[str, torch.Tensor, torch.Tensor, int]


class StepOutputs:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, batch: InputBatch,
                 grammars: Callable[[], Grammars]) -> None:
        """`grammars`: the worker's grammar cache, built on first use."""
        self.model = model
        self.model_config = model_config
        self.batch = batch
        self.grammars = grammars

    def sample(
        self, step_id: int, inputs: StepInputs, requests: dict[str, RequestState], logits: torch.Tensor | None,
        prompt_logits: list[PromptLogits], spec_logits: torch.Tensor | None = None,
    ) -> StepResult:
        """The sampling rank's result: tokens from the processed logits, logprobs from the raw ones;
        with `spec_logits`, the verification of the drafts in `inputs.spec_requests`."""
        result = StepResult(step_id)
        if spec_logits is not None and inputs.spec_requests:
            self._verify(result, inputs.spec_requests, requests, spec_logits)
        if logits is not None and inputs.sampling is not None:
            states = [requests[r] for r in inputs.sample_request_ids]
            for state in states:
                if state.generator is not None:
                    position = len(state.token_ids) + state.num_sampled_ahead - state.num_prompt_tokens
                    state.generator.manual_seed(position_seed(state.sampling_params.seed, position))
            adjustments = LogitsAdjustments.build(
                states, self.model_config.vocab_size, self.model_config.eos_token_ids, logits.device
            )
            processed = adjustments.apply(logits) if adjustments else logits
            grammars = [s.grammar for s in states]
            if any(grammars):
                # Masked in place on a copy: logprobs report the model's raw distribution.
                processed = processed.clone() if processed is logits else processed
                self.grammars().mask(processed, grammars)
            sampled = sample(processed, inputs.sampling)
            self.batch.last_sampled[inputs.sample_batch_rows] = sampled
            for state in states:
                state.num_sampled_ahead += 1
            tokens = sampled.tolist()
            if any(grammars):
                self.grammars().accept(grammars, tokens)
            for request_id, token in zip(inputs.sample_request_ids, tokens):
                result.sampled_token_ids[request_id] = [token]
            wanted = [s.sampling_params.logprobs for s in states]
            if any(n is not None for n in wanted):
                for row, entry in gather_logprobs(logits, sampled, wanted).items():
                    result.logprobs[inputs.sample_request_ids[row]] = [entry]
        for request_id, scored, targets, top in prompt_logits:
            entries = gather_logprobs(scored, targets, [top] * len(targets))
            result.prompt_logprobs[request_id] = [entries[row] for row in range(len(targets))]
        return result

    def _verify(self, result: StepResult, spec_requests: list[tuple[str, list[int]]],
                requests: dict[str, RequestState], logits: torch.Tensor) -> None:
        states = [requests[request_id] for request_id, _ in spec_requests]
        checked = logits
        constrained = any(state.grammar is not None for state in states)
        if constrained:
            # Drafts the grammars refuse are dropped; the rest verified against masked logits.
            spec_requests, logits, checked = constrain_drafts(spec_requests, states, logits,
                                                              self.model_config.vocab_size)
        if any(adjusts(state.sampling_params) for state in states):  # after the mask as before: -inf stays -inf
            positions = at_each_position(states, [drafts for _, drafts in spec_requests])
            adjustments = LogitsAdjustments.build(positions, self.model_config.vocab_size,
                                                  self.model_config.eos_token_ids, logits.device)
            checked = adjustments.apply(checked) if adjustments else checked
        emitted = verify(checked, [(s.sampling_params, drafts) for s, (_, drafts) in zip(states, spec_requests)],
                         [_proposal(state, drafts) for state, (_, drafts) in zip(states, spec_requests)],
                         [(s.generator, len(s.output_token_ids)) if s.generator is not None else None for s in states])
        if constrained:
            advance(self.grammars(), states, emitted)
        first_row = 0
        for (request_id, drafts), state, tokens in zip(spec_requests, states, emitted):
            result.sampled_token_ids[request_id] = tokens
            state.num_sampled_ahead += len(tokens)
            wanted = state.sampling_params.logprobs
            if wanted is not None:  # of the raw logits at each emitted token's position
                rows = logits[first_row : first_row + len(tokens)]
                entries = gather_logprobs(rows, torch.tensor(tokens, device=rows.device), [wanted] * len(tokens))
                result.logprobs[request_id] = [entries[i] for i in range(len(tokens))]
            first_row += len(drafts) + 1

    def prompt_logits(
        self, plan: StepPlan, requests: dict[str, RequestState], row_starts: list[int], hidden: torch.Tensor
    ) -> list[PromptLogits]:
        """The logits of the prompt positions this step computed, for the requests that
        asked for prompt logprobs, with the tokens they score."""
        found = []
        for (request_id, count), first_row in zip(plan.num_scheduled_tokens.items(), row_starts):
            state = requests[request_id]
            top = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            # Position p predicts prompt token p + 1, so the last prompt position has nothing to score.
            end = min(start + count, state.num_prompt_tokens - 1)
            if top is None or start >= end:
                continue
            logits = self.model.compute_logits(hidden[first_row : first_row + end - start])
            if logits is not None:
                targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=hidden.device)
                found.append((request_id, logits, targets, top))
        return found


def _proposal(state: RequestState, drafts: list[int]) -> torch.Tensor | None:
    """The distributions a draft model sampled `drafts` from, when these are its drafts;
    None verifies them as point masses, exact whatever proposed them (only less often accepted)."""
    if state.draft_probs is None or state.draft_token_ids[: len(drafts)] != drafts:
        return None
    return state.draft_probs[: len(drafts)]
