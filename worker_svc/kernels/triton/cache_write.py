"""Writing a step's new K and V into the paged cache through the slot mapping (Triton).

One program per token copies every KV head of that token; a slot below zero marks a
padding row (CUDA graphs pad a batch to a captured size) and writes nothing, so the
padded batch needs no second, trimmed slot mapping.
"""
from __future__ import annotations

import torch

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before triton: it picks the interpreter where there is no CUDA)

# isort: split
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    # Clamped so that a padding row's (masked) addresses stay inside the cache.
    slot = tl.maximum(slot, 0)
    cache_offset = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_offset += heads[:, None] * stride_ch + dims[None, :]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key` and `value` [T, num_kv_heads, head_dim] to `kv_cache` [2, num_blocks, block_size,
    num_kv_heads, head_dim] at `slot_mapping` [T] (block_id * block_size + offset; < 0: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    # The kernel walks the head dimension with unit stride in every tensor.
    assert key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
