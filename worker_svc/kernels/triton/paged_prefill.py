"""Varlen paged prefill attention in Triton: chunked prompts, prefix-cache hits and
decodes in one call.

Every key is read in place from the paged cache (the chunk's own keys included,
written there just before), so a chunk after a cached prefix costs no gather, and the
batch is never padded to its longest request: one program per (request, query tile,
KV head), where a tile's rows are BLOCK_Q query tokens times the GQA group, so that
`tl.dot` has at least 16 rows even for one-token (decode) requests' groups of 8 or more.
Programs past a request's last query tile find no keys to read and store nothing.
"""
from __future__ import annotations

import math

import torch

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before triton: it picks the interpreter where there is no CUDA)

# isort: split
import triton
import triton.language as tl

from worker_svc.kernels.triton.attention_tile import attend_tile
from worker_svc.kernels.triton.paged_decode import dot_dtype

TILE_ROWS = 64  # query rows (tokens x group heads) per program
TILE_KEYS = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys before this chunk: query token j sits at position context + j

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    dims = tl.arange(0, DIM_PAD)
    q_mask = ((token < q_len) & (rows % GROUP_PAD < GROUP))[:, None] & (dims[None, :] < HEAD_DIM)
    q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32).to(DOT_DTYPE)
    q_pos = context + token
    # Keys up to the tile's last query token; none for a tile past the request's end.
    tile_first = q_tile * BLOCK_Q
    kv_end = tl.where(tile_first < q_len, context + tl.minimum(tile_first + BLOCK_Q, q_len), 0)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)  # running max score (base 2)
    total = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    keys = tl.arange(0, TILE_N)
    for start in range(0, kv_end, TILE_N):
        pos = start + keys
        key_mask = pos < kv_end
        # Key 0 is visible to every row, so each row's max is finite after the first tile
        # and a later tile hidden from a row entirely only adds exp2(-inf) = 0 to it.
        visible = key_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m, total, acc = attend_tile(
            q, m, total, acc, table, pos, key_mask, visible, k_cache_ptr, v_cache_ptr, kv_head, dims,
            qk_scale, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, DOT_DTYPE,
        )

    out = acc / tl.maximum(total, 1.0)[:, None]  # total >= 1 wherever a row had keys
    o_offsets = (q_start + token).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `query` [T, num_heads, head_dim], request i's tokens at rows
    `query_start_loc` [B + 1] (int32) i to i + 1 and the last of its `seq_lens` [B] positions,
    over `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim] through `block_tables`
    [B, max_blocks] (int32). The requests' new K and V must already be in the cache."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    assert query.stride(2) == out.stride(2) == kv_cache.stride(4) == block_tables.stride(1) == 1
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, TILE_ROWS // group_pad)
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query, kv_cache[0], kv_cache[1], block_tables, query_start_loc, seq_lens, out,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        TILE_N=TILE_KEYS, DOT_DTYPE=dot_dtype(kv_cache),
    )
    return out
