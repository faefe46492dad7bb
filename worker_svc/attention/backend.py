"""The attention-backend interface: how a model layer reads and writes the paged KV cache.

A backend turns the step's batch layout into its own metadata once per step (shared
by every layer), then runs attention per layer. The torch backend is the CPU
reference; GPU backends implement the same two methods.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """Where each request's tokens sit in the flattened batch and in the KV pool."""

    query_lens: torch.Tensor  # [B] tokens computed this step per request
    seq_lens: torch.Tensor  # [B] tokens of KV per request once this step is done
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] where each new token's K and V are written
    block_size: int
    max_query_len: int  # known on the host, so no backend syncs with the device to learn it
    # The requests (their indices) whose tokens are a decode and its speculative drafts.
    verifying: tuple[int, ...] = ()


class AttentionBackend(ABC):
    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> object:
        """Per-step precomputation shared by all layers."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: object,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K and V into the cache, then attend over each request's context."""
