"""Split-KV paged decode attention (flash-decoding) in Triton.

A decode has one query token, so one program per sequence would leave most of a GPU
idle on a small batch with long contexts. Each sequence's keys are cut into
`num_splits` contiguous ranges instead: one program per (sequence, KV head, split)
reads its range's K and V blocks in place through the block table and keeps a partial
output with its log-sum-exp, and a second small kernel merges the splits. A program
takes every query head of its KV head (the GQA group, padded to 16 rows so that
`tl.dot` is valid on a GPU), so each K and V tile is loaded once per group.
"""
from __future__ import annotations

import math

import torch

# Before triton: it picks the interpreter where there is no CUDA.
from worker_svc.kernels.triton.interpreter import INTERPRETED

# isort: split
import triton
import triton.language as tl

from worker_svc.kernels.triton.attention_tile import attend_tile

TILE_KEYS = 64  # keys per loop step, gathered from as many blocks as they span
KEYS_PER_SPLIT = 512  # below this, a split's fixed cost (partial write, merge) outweighs its parallelism
MAX_SPLITS = 16

_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(cache: torch.Tensor) -> tl.dtype:
    """What `tl.dot` multiplies: the cache's own type on a GPU (tensor cores); float32 in the
    interpreter, whose bfloat16 arithmetic is wrong (numpy has no bfloat16)."""
    return tl.float32 if INTERPRETED else _TRITON_DTYPES[cache.dtype]


def choose_num_splits(max_context: int) -> int:
    return max(1, min(MAX_SPLITS, -(-max_context // KEYS_PER_SPLIT)))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DIRECT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    q_mask = (rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32).to(DOT_DTYPE)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max score (base 2)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    keys = tl.arange(0, TILE_N)
    for tile in range(tile_begin, tile_end):
        pos = tile * TILE_N + keys
        key_mask = pos < seq_len  # every tile holds at least one key: the rows' max is finite from the first
        m, total, acc = attend_tile(
            q, m, total, acc, table, pos, key_mask, key_mask[None, :], k_cache_ptr, v_cache_ptr, kv_head, dims,
            qk_scale, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, DOT_DTYPE,
        )

    # `total` is 0 for a split with no keys and at least 1 otherwise (the max key adds
    # exp2(0)), so dividing by max(total, 1) gives 0 for an empty split and lse is -inf.
    total = tl.maximum(total, 1.0)
    out = acc / total[:, None]
    if DIRECT:
        dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits + split
        tl.store(part_lse_ptr + part, m + tl.log2(total), mask=rows < GROUP)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part = (seq * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    # A sequence with no keys at all (a padding row) has every split at -inf: output 0.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    mask = (splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of `query` [B, num_heads, head_dim] (one token per sequence, the last of its
    `seq_lens` [B] keys) over `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim]
    through `block_tables` [B, max_blocks] (int32). `num_splits` defaults to one per
    KEYS_PER_SPLIT keys the block tables can hold, so it depends on shapes only: fix it (and
    the table width) to replay under a CUDA graph. Returns `out` [B, num_heads, head_dim]."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(block_tables.shape[1] * block_size)
    if out is None:
        out = torch.empty_like(query)
    assert query.stride(2) == out.stride(2) == kv_cache.stride(4) == block_tables.stride(1) == 1
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    direct = num_splits == 1
    # Scratch is per call: under CUDA graph capture it comes from the graph's own pool. One
    # element when unused, so that the kernel never gets a null pointer.
    parts = 1 if direct else batch * num_heads * num_splits
    part_out = query.new_empty(parts * head_dim, dtype=torch.float32)
    part_lse = query.new_empty(parts, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, part_out, part_lse,
        scale * math.log2(math.e), num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE_N=TILE_KEYS,
        DOT_DTYPE=dot_dtype(kv_cache), DIRECT=direct,
    )
    if not direct:
        _merge_splits_kernel[(batch, num_heads)](
            out, part_out, part_lse, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
