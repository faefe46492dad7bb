"""Per-request state the worker keeps between steps, and the persistent batch that turns
a step plan into the model's input tensors.

The batch gives every request it holds a row, kept on the worker's device from step to
step: the row's block table and sampling settings are written once, when the request
arrives, and a plan's deltas then only append the new block ids. A step uploads what is
new in it, in one copy: its token ids with their positions and requests, and per scheduled
request its row, count and length; slots and block tables are computed on the device from
the rows. Rebuilding every request's whole block table each step cost a decode step time
and bytes in proportion to the context held, not to the work done.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.lora_request import LoRARequest
from services.messages import StepPlan
from services.sampling_params import SamplingParams
from worker_svc.attention.backend import BatchLayout
from worker_svc.runtime.sampling.sampler import SamplingBatch

if TYPE_CHECKING:  # xgrammar loads transformers: only workers that meet a constraint import it
    from worker_svc.runtime.sampling.grammar import RequestGrammar

_INITIAL_ROWS = 64


@dataclass
class RequestState:
    token_ids: list[int]  # prompt and every token sampled so far
    num_prompt_tokens: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    grammar: RequestGrammar | None = None  # for a request with structured outputs
    row: int = -1  # its row in the InputBatch, once added
    # Tokens this worker sampled that token_ids does not hold yet: the plans bring them
    # one step later, or (async scheduling) two, and a step ahead reads its input from
    # the InputBatch's last_sampled on the device meanwhile.
    num_sampled_ahead: int = 0
    # A pooling request's vector so far (worker_svc/runtime/pooler.py: MEAN's running sum).
    pooled: torch.Tensor | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # The draft model's last drafts for it and, when it samples, the distributions [n, V]
    # they were drawn from: its verification accepts with min(1, p/q) (speculative decoding).
    draft_token_ids: list[int] | None = None
    draft_probs: torch.Tensor | None = None
    # On a rank that does not sample (a worker group's): drafts verified in its last step,
    # counted as computed until the next plan says how many were accepted.
    unverified_drafts: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    sample_rows: torch.Tensor  # [S] rows (of the flattened batch) whose logits are sampled
    sample_request_ids: list[str]
    sample_batch_rows: torch.Tensor  # [S] their rows in the InputBatch
    sampling: SamplingBatch | None  # for the sampled rows; None when nothing samples
    row_starts: list[int]  # each scheduled request's first row, in plan order
    # Speculative decoding: the rows (of the flattened batch) of the requests given drafts,
    # each request's last token and its drafts, all verified; and those requests in order.
    spec_rows: torch.Tensor | None = None
    spec_requests: list[tuple[str, list[int]]] | None = None
    token_requests: torch.Tensor | None = None  # [T] each row's index in plan order (on the device)


class InputBatch:
    def __init__(self, max_blocks_per_request: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.max_blocks = max_blocks_per_request
        self.block_table = torch.zeros((0, max_blocks_per_request), dtype=torch.int32, device=device)
        self.temperature = torch.zeros(0, dtype=torch.float32, device=device)
        self.top_p = torch.zeros(0, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(0, dtype=torch.long, device=device)
        self.min_p = torch.zeros(0, dtype=torch.float32, device=device)
        self.last_sampled = torch.zeros(0, dtype=torch.long, device=device)  # per row: its newest sampled token
        self.num_blocks: list[int] = []  # per row: block ids written so far
        self.free_rows: list[int] = []
        self.uploaded_bytes = 0  # host-to-device bytes since the last reset, for tests and benchmarks
        self._grow(_INITIAL_ROWS)

    def _grow(self, rows: int) -> None:
        """Room for `rows` more requests: the columns are reallocated, their contents kept."""
        old = len(self.num_blocks)
        self.block_table = torch.cat([self.block_table, self.block_table.new_zeros((rows, self.max_blocks))])
        for name in ("temperature", "top_p", "top_k", "min_p", "last_sampled"):
            column = getattr(self, name)
            setattr(self, name, torch.cat([column, column.new_zeros(rows)]))
        self.num_blocks += [0] * rows
        self.free_rows += range(old + rows - 1, old - 1, -1)  # lowest row first

    def add(self, state: RequestState, block_ids: list[int]) -> None:
        """Gives a new request a row and writes its block table and sampling settings."""
        if not self.free_rows:
            self._grow(len(self.num_blocks))
        row = state.row = self.free_rows.pop()
        params = state.sampling_params
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        # Through a float32 tensor: a temperature past float32's range becomes inf, as it
        # would in any tensor of the batch, where assigning the Python float would raise.
        self.temperature[row] = torch.tensor(params.temperature, dtype=torch.float32)
        self.top_p[row], self.top_k[row], self.min_p[row] = params.top_p, params.top_k, params.min_p
        self.uploaded_bytes += 4 * 4

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        first = self.num_blocks[row]
        if first + len(block_ids) > self.max_blocks:
            raise RuntimeError(f"a request holds {first + len(block_ids)} blocks, more than max_model_len's "
                               f"{self.max_blocks}: the scheduler's plan is wrong")
        ids = torch.tensor(block_ids, dtype=torch.int32)
        self.block_table[row, first : first + len(block_ids)] = ids.to(self.device, non_blocking=True)
        self.num_blocks[row] = first + len(block_ids)
        self.uploaded_bytes += ids.nbytes

    def remove(self, state: RequestState) -> None:
        self.free_rows.append(state.row)
        state.row = -1

    def prepare(self, plan: StepPlan, requests: dict[str, RequestState]) -> StepInputs:
        """The step's inputs in plan order: the scheduled tokens, and where each sits."""
        counts = list(plan.num_scheduled_tokens.values())
        states = [requests[request_id] for request_id in plan.num_scheduled_tokens]
        input_ids: list[int] = []
        positions: list[int] = []
        request_of_token: list[int] = []
        row_starts: list[int] = []
        sample_rows: list[int] = []
        sampled: list[tuple[str, RequestState]] = []
        pending: list[int] = []  # where a token sampled on the device goes in input_ids
        pending_rows: list[int] = []
        spec_rows: list[int] = []
        spec_requests: list[tuple[str, list[int]]] = []
        verifying: list[int] = []
        for index, ((request_id, state), count) in enumerate(zip(zip(plan.num_scheduled_tokens, states), counts)):
            start = state.num_computed_tokens
            row_starts.append(len(input_ids))
            known = state.token_ids[start : start + count]
            if drafts := plan.scheduled_spec_decode_tokens.get(request_id):
                # The request's last token, then its drafts: every position is verified.
                if start + count - len(drafts) != len(state.token_ids) or state.num_sampled_ahead:
                    raise RuntimeError(f"worker out of sync on {request_id}: {len(drafts)} drafts after "
                                       f"{count - len(drafts)} tokens from {start}, it knows {len(state.token_ids)}")
                spec_rows += range(len(input_ids), len(input_ids) + count)
                spec_requests.append((request_id, drafts))
                verifying.append(index)
                input_ids += known + drafts
                positions += range(start, start + count)
                request_of_token += [index] * count
                continue
            if len(known) < count:
                if count - len(known) != 1 or not state.num_sampled_ahead:
                    raise RuntimeError(f"worker out of sync on {request_id}: {count} tokens from {start} "
                                       f"scheduled, it knows {len(state.token_ids)} and sampled "
                                       f"{state.num_sampled_ahead} more")
                pending.append(len(input_ids) + len(known))
                pending_rows.append(state.row)
                known.append(0)
            input_ids += known
            positions += range(start, start + count)
            request_of_token += [index] * count
            # Only a chunk that reaches the last token (sampled here or not) yields a new token;
            # a pooling request's yields its vector instead (worker_svc/runtime/pooler.py).
            if (start + count == len(state.token_ids) + state.num_sampled_ahead
                    and state.sampling_params.pooling is None):
                sample_rows.append(len(input_ids) - 1)
                sampled.append((request_id, state))
        # Index lists are built here, where a range costs C speed, and go up in one copy: a
        # step of few rows paid more for a score of small device ops than for its tokens.
        lengths = [s.num_computed_tokens + n for s, n in zip(states, counts)]
        (rows, query_lens, seq_lens, token_requests, token_positions, tokens, sample_index, sample_batch_rows,
         pending_index, pending_batch_rows, spec_index) = self._upload(
            [[s.row for s in states], counts, lengths, request_of_token, positions, input_ids, sample_rows,
             [s.row for _, s in sampled], pending, pending_rows, spec_rows])
        block_tables = self.block_table[rows, : -(-max(lengths) // self.block_size)]
        slot_mapping = (block_tables[token_requests, token_positions // self.block_size].long() * self.block_size
                        + token_positions % self.block_size)
        if pending:
            tokens[pending_index] = self.last_sampled[pending_batch_rows]
        return StepInputs(
            input_ids=tokens,
            positions=token_positions,
            layout=BatchLayout(query_lens, seq_lens, block_tables, slot_mapping, self.block_size, max(counts),
                               tuple(verifying)),
            sample_rows=sample_index,
            sample_request_ids=[request_id for request_id, _ in sampled],
            sample_batch_rows=sample_batch_rows,
            sampling=self._sampling(sample_batch_rows, [s for _, s in sampled]) if sampled else None,
            row_starts=row_starts,
            spec_rows=spec_index if spec_requests else None,
            spec_requests=spec_requests or None,
            token_requests=token_requests,
        )

    def _sampling(self, rows: torch.Tensor, states: list[RequestState]) -> SamplingBatch:
        return SamplingBatch.of([s.sampling_params for s in states], [s.generator for s in states],
                                (self.temperature[rows], self.top_p[rows], self.top_k[rows], self.min_p[rows]))

    def _upload(self, columns: list[list[int]]) -> list[torch.Tensor]:
        """Several int lists in one host-to-device copy, as int64 tensors on the device."""
        packed = torch.tensor([value for column in columns for value in column], dtype=torch.long)
        self.uploaded_bytes += packed.nbytes
        return list(packed.to(self.device, non_blocking=True).split([len(column) for column in columns]))
