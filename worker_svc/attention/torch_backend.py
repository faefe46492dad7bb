"""Reference paged attention in plain torch, for the CPU.

Decodes (one query token each) run as one padded, masked SDPA call over the whole
group; prompt chunks run one SDPA call each. Index tensors and masks are built once
per step and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.attention.backend import AttentionBackend, BatchLayout


@dataclass
class PrefillSpan:
    start: int  # first row in the flattened batch
    end: int
    # Slots of the whole context (cached prefix + this chunk) and the causal mask
    # over it; both None when the chunk is the whole context and plain causal works.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor  # [Bd] batch rows of the single-token requests
    decode_slots: torch.Tensor  # [Bd, Lmax] context slots, padded
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] True where a slot is real context
    prefills: list[PrefillSpan]


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat KV slots of the first `length` positions, for one or many block tables."""
    positions = torch.arange(length, device=block_table.device)
    return block_table[..., positions // block_size] * block_size + positions % block_size


class TorchAttentionBackend(AttentionBackend):
    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        query_lens = layout.query_lens.tolist()
        seq_lens = layout.seq_lens.tolist()
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decode_idx = [i for i, n in enumerate(query_lens) if n == 1]
        prefills = []
        for i, n in enumerate(query_lens):
            if n == 1:
                continue
            start, end, context = starts[i], starts[i + 1], seq_lens[i]
            if context == n:
                prefills.append(PrefillSpan(start, end, None, None))
                continue
            slots = _context_slots(layout.block_tables[i], context, layout.block_size)
            # Query j sits at position context - n + j and sees keys up to it.
            query_pos = torch.arange(context - n, context, device=device)[:, None]
            mask = torch.arange(context, device=device)[None, :] <= query_pos
            prefills.append(PrefillSpan(start, end, slots, mask))
        decode_index = torch.tensor(decode_idx, dtype=torch.long, device=device)
        decode_rows = torch.tensor([starts[i] for i in decode_idx], dtype=torch.long, device=device)
        decode_lens = layout.seq_lens[decode_index]
        max_len = int(decode_lens.max()) if decode_idx else 0
        decode_slots = _context_slots(layout.block_tables[decode_index], max_len, layout.block_size)
        decode_mask = (torch.arange(max_len, device=device)[None, :] < decode_lens[:, None])[:, None, None, :]
        return TorchAttentionMetadata(layout.slot_mapping, decode_rows, decode_slots, decode_mask, prefills)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, key)
        value_cache.index_copy_(0, metadata.slot_mapping, value)

        output = torch.empty_like(query)
        if len(metadata.decode_rows):
            q = query[metadata.decode_rows].unsqueeze(2)  # [Bd, H, 1, D]
            k = key_cache[metadata.decode_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
            v = value_cache[metadata.decode_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True
            )
            output[metadata.decode_rows] = out.squeeze(2)
        for span in metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1)  # [H, n, D]
            if span.context_slots is None:
                k = key[span.start : span.end].transpose(0, 1)
                v = value[span.start : span.end].transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k = key_cache[span.context_slots].transpose(0, 1)
                v = value_cache[span.context_slots].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=span.mask, scale=scale, enable_gqa=True
                )
            output[span.start : span.end] = out.transpose(0, 1)
        return output
