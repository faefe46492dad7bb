"""The GPU attention backend: Triton kernels that read the paged KV cache in place.

No gather of K and V blocks and no padding of the batch to its longest request: a step
of decodes only runs the split-KV decode kernel, any other step one varlen prefill
kernel call over all its rows (decodes included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.attention.backend import AttentionBackend, BatchLayout
from worker_svc.kernels.triton.cache_write import reshape_and_cache
from worker_svc.kernels.triton.paged_decode import choose_num_splits, paged_decode_attention
from worker_svc.kernels.triton.paged_prefill import paged_prefill_attention


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, < 0 for padding rows
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    num_splits: int  # decode splits per sequence


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, num_splits: int | None = None) -> None:
        """`num_splits`: fix the decode kernel's splits (for CUDA graphs), instead of choosing
        them each step from the block tables' width."""
        self.num_splits = num_splits

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        query_lens = layout.query_lens.to(torch.int32)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=query_lens.device)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        block_tables = layout.block_tables.to(torch.int32)
        num_splits = self.num_splits or choose_num_splits(block_tables.shape[1] * layout.block_size)
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping.to(torch.int64),
            block_tables=block_tables.contiguous(),
            seq_lens=layout.seq_lens.to(torch.int32),
            query_start_loc=query_start_loc,
            max_query_len=layout.max_query_len,
            num_splits=num_splits,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        if metadata.max_query_len == 1:
            return paged_decode_attention(
                query, kv_cache, metadata.block_tables, metadata.seq_lens, scale, num_splits=metadata.num_splits
            )
        return paged_prefill_attention(
            query, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            metadata.max_query_len, scale,
        )
