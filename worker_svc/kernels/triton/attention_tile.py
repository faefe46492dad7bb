"""The step both paged attention kernels repeat: one tile of keys, read in place through
the block table, folded into a running (base-2) online softmax."""
from __future__ import annotations

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before triton: it picks the interpreter where there is no CUDA)

# isort: split
import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q, m, total, acc, table, pos, key_mask, visible, k_cache_ptr, v_cache_ptr, kv_head, dims, qk_scale,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Keys at positions `pos` [N] (those in `key_mask` exist) against the query rows `q`,
    row r seeing key n where `visible` [rows, N] says so; returns the updated running max
    `m`, softmax sum `total` and weighted values `acc`. A row must have seen a key by its
    first tile: its max is -inf until then, and -inf - -inf is NaN."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    offsets = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = key_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, total, acc
