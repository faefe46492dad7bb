"""Per-request state the worker keeps between steps, and the step's input tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.messages import StepPlan
from services.sampling_params import SamplingParams
from worker_svc.attention.backend import BatchLayout

if TYPE_CHECKING:  # xgrammar loads transformers: only workers that meet a constraint import it
    from worker_svc.grammar import RequestGrammar


@dataclass
class RequestState:
    token_ids: list[int]  # prompt and every token sampled so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    grammar: RequestGrammar | None = None  # for a request with structured outputs

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    sample_rows: torch.Tensor  # [S] rows whose logits are sampled
    sample_request_ids: list[str]
    row_starts: list[int]  # each scheduled request's first row, in plan order


def prepare_inputs(
    plan: StepPlan, requests: dict[str, RequestState], block_size: int, device: torch.device
) -> StepInputs:
    """Gather the scheduled tokens in plan order; index math runs on the CPU, then moves once."""
    request_ids = list(plan.num_scheduled_tokens)
    counts = list(plan.num_scheduled_tokens.values())
    input_ids: list[int] = []
    starts: list[int] = []
    block_tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_request_ids: list[str] = []
    row_starts: list[int] = []
    for request_id, count in zip(request_ids, counts):
        state = requests[request_id]
        start = state.num_computed_tokens
        row_starts.append(len(input_ids))
        input_ids += state.token_ids[start : start + count]
        starts.append(start)
        block_tables.append(state.block_ids)
        # Only a chunk that reaches the last known token yields a new token.
        if start + count == len(state.token_ids):
            sample_rows.append(len(input_ids) - 1)
            sample_request_ids.append(request_id)

    query_lens = torch.tensor(counts, dtype=torch.long)
    start_positions = torch.tensor(starts, dtype=torch.long)
    request_of_token = torch.repeat_interleave(torch.arange(len(counts)), query_lens)
    offsets = torch.cumsum(query_lens, 0) - query_lens
    positions = torch.arange(len(input_ids)) - offsets[request_of_token] + start_positions[request_of_token]
    width = max(len(blocks) for blocks in block_tables)
    table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in block_tables], dtype=torch.long)
    slot_mapping = table[request_of_token, positions // block_size] * block_size + positions % block_size
    layout = BatchLayout(
        query_lens=query_lens.to(device),
        seq_lens=(start_positions + query_lens).to(device),
        block_tables=table.to(device),
        slot_mapping=slot_mapping.to(device),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=positions.to(device),
        layout=layout,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_request_ids=sample_request_ids,
        row_starts=row_starts,
    )
