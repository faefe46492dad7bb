"""Speculative decoding's draft_model method: a smaller model with the target's tokenizer,
run by the same worker, proposes the drafts the next step verifies.

Its KV cache has its own tensors (its layers and heads) over the target's block ids, so
the scheduler's block tables, allocations and prefix cache serve both. Every step it runs
over the target's scheduled tokens at their slots (prompt chunks, last tokens and drafts
alike), so its KV at every computed position holds the same tokens as the target's; a
rejected draft's slot is written again with the token that replaces it. After the target
has sampled, each request that may speculate decodes up to k tokens with it, one forward
per token, from its newest token: the drafts travel back in the step's result and come in
the next plan, so proposing and verifying take no extra round trip. A greedy request's
drafts are the draft model's argmax. A request that samples draws its drafts from the
draft's distribution q (after its temperature, top-k, top-p and min-p), kept on its
state: the rejection sampler accepts each with min(1, p/q) and resamples from
max(p - q, 0), as in the paper, so every emitted token follows the target exactly.
The scheduler allocates k lookahead slots past each step's tokens for the drafts' KV.
"""
from __future__ import annotations

import dataclasses

import torch

from services.config import EngineConfig
from services.messages import StepPlan
from services.model_source import resolve_model
from worker_svc.attention.backend import BatchLayout
from worker_svc.formats.model_config import read_model_config
from worker_svc.group.rank_group import RankGroup
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.weights import load_weights
from worker_svc.runtime import kernel_choice
from worker_svc.runtime.batch import InputBatch, RequestState, StepInputs
from worker_svc.runtime.cuda_graphs import DecodeGraphs, forward_rows
from worker_svc.runtime.device import runs_q4_as_stored
from worker_svc.runtime.kv_cache import allocate_kv_cache, bytes_per_block
from worker_svc.runtime.sampling.sampler import SamplingBatch, argmax, draw, probabilities


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        # The draft's own quantization when given (vLLM's key), else the target's flag.
        draft_config = dataclasses.replace(config, model=spec.model,
                                           quantization=spec.quantization or config.quantization)
        source = resolve_model(spec.model, require_tokenizer=False)
        keep_q4 = runs_q4_as_stored(draft_config, device, read_model_config(source))
        self.config, weights = load_weights(source, dtype, keep_quantized=keep_q4)
        self.backend = kernel_choice.attention_backend(draft_config, device, self.config, dtype)
        with torch.device("meta"):
            self.model = LlamaForCausalLM(self.config, self.backend, max_model_len, device, RankGroup(),
                                          kernel_choice.decoder_ops(draft_config, device, dtype))
        self.model.load_weights({name: t.to(device) for name, t in weights.items()})
        self.model.eval()
        self.device = device
        self.draft_config = draft_config
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return bytes_per_block(self.config, block_size, kv_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, kv_dtype, self.device)

    def capture_graphs(self, batch: InputBatch) -> None:
        """CUDA graphs of the draft's own, as the target's (a GPU, the Triton kernels, not
        --enforce-eager): its decodes, and its run over a step of decodes with their drafts.
        Captured on a worker group too: the draft runs on one rank, with no collective."""
        self.graphs = kernel_choice.decode_graphs(self.draft_config, self.device, RankGroup(), self.model,
                                                  self.backend, self.kv_caches, batch)

    def run(self, plan: StepPlan, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """The step's tokens through the draft: its KV at their slots (a draft model reads
        the tokens only, not the plan's order or the target's hidden states an EAGLE head reads)."""
        self._forward(inputs.input_ids, inputs.positions, inputs.layout, inputs.row_starts)

    def propose(self, emitted: dict[str, list[int]], requests: dict[str, RequestState], batch: InputBatch,
                probes: set[str]) -> dict[str, list[int]]:
        """Per request that emitted tokens this step and may speculate: up to k drafts to
        follow them, as far as its blocks reach (the scheduler's lookahead slots); one for
        the `probes` (StepPlan.draft_probes)."""
        ids, rows, tokens, starts, counts = [], [], [], [], []
        for request_id, sampled in emitted.items():
            state = requests[request_id]
            state.draft_token_ids = state.draft_probs = None
            position = len(state.token_ids) + state.num_sampled_ahead - 1  # of its newest token
            count = draft_count(1 if request_id in probes else self.k, state, position, batch)
            if count > 0:
                ids.append(request_id)
                rows.append(state.row)
                tokens.append(sampled[-1])
                starts.append(position)
                counts.append(count)
        drafts: dict[str, list[int]] = {request_id: [] for request_id in ids}
        proposals: dict[str, list[torch.Tensor]] = {request_id: [] for request_id in ids}
        for step in range(max(counts, default=0)):
            live = [i for i, count in enumerate(counts) if count > step]
            logits = self._decode([rows[i] for i in live], [tokens[i] for i in live],
                                  [starts[i] + step for i in live], batch)
            new, probs = draw_drafts(logits, [requests[ids[i]] for i in live], [rows[i] for i in live], batch)
            for j, (i, token) in enumerate(zip(live, new)):
                drafts[ids[i]].append(token)
                tokens[i] = token
                if probs[j] is not None:
                    proposals[ids[i]].append(probs[j])
        keep_drafts(requests, drafts, proposals)
        return drafts

    def _decode(self, rows: list[int], tokens: list[int], positions: list[int], batch: InputBatch) -> torch.Tensor:
        """One token per request at `positions` through the draft: the logits of its next tokens."""
        position, layout = decode_layout(rows, positions, batch)
        hidden = self._forward(torch.tensor(tokens, dtype=torch.long, device=self.device), position, layout,
                               list(range(len(rows))))
        return self.model.compute_logits(hidden)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
                 row_starts: list[int]) -> torch.Tensor:
        return forward_rows(self.graphs, self.model, self.backend, self.kv_caches, (input_ids,), positions, layout,
                            row_starts)


def draw_drafts(logits: torch.Tensor, states: list[RequestState], rows: list[int],
                batch: InputBatch) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each request's draft: the argmax when it is greedy, else a draw from q (its
    sampling settings over the draft's logits), with q."""
    tokens = argmax(logits)
    sampled = [j for j, state in enumerate(states) if not state.sampling_params.greedy]
    q: list[torch.Tensor | None] = [None] * len(states)
    if sampled:
        index = torch.tensor([rows[j] for j in sampled], device=logits.device)
        settings = SamplingBatch.of([states[j].sampling_params for j in sampled], [None] * len(sampled),
                                    (batch.temperature[index], batch.top_p[index], batch.top_k[index],
                                     batch.min_p[index]))
        probs = probabilities(logits[sampled], settings)
        tokens[sampled] = draw(probs)
        for j, row in zip(sampled, probs):
            q[j] = row
    return tokens.tolist(), q


def keep_drafts(requests: dict[str, RequestState], drafts: dict[str, list[int]],
                proposals: dict[str, list[torch.Tensor]]) -> None:
    """Each request's drafts, and the draws' distributions q where it samples, for verification."""
    for request_id, tokens in drafts.items():
        state = requests[request_id]
        state.draft_token_ids = tokens
        if proposals[request_id]:
            state.draft_probs = torch.stack(proposals[request_id])


def draft_count(k: int, state: RequestState, position: int, batch: InputBatch) -> int:
    """How many drafts may follow a request's newest token at `position`: at most k, as far
    as its blocks reach (the scheduler's lookahead slots), never past its max_tokens."""
    count = min(k, batch.num_blocks[state.row] * batch.block_size - position)
    if (max_tokens := state.sampling_params.max_tokens) is not None:  # drafts past it would be cut
        count = min(count, max_tokens - (position + 1 - state.num_prompt_tokens) - 1)
    return count


def decode_layout(rows: list[int], positions: list[int], batch: InputBatch) -> tuple[torch.Tensor, BatchLayout]:
    """One token per request (its InputBatch row) at `positions`: the positions as a tensor
    and the attention layout over the requests' blocks."""
    device, block_size = batch.device, batch.block_size
    position = torch.tensor(positions, dtype=torch.long, device=device)
    block_tables = batch.block_table[torch.tensor(rows, device=device), : max(positions) // block_size + 1]
    slots = (block_tables[torch.arange(len(rows), device=device), position // block_size].long() * block_size
             + position % block_size)
    return position, BatchLayout(torch.ones(len(rows), dtype=torch.long, device=device), position + 1,
                                 block_tables, slots, block_size, 1)
