"""Fused Triton kernels for the Llama decoder's elementwise work: residual add + RMSNorm,
neox-style rotary embedding, and SiLU-and-multiply.

Each reads its inputs once and writes its outputs once, where the torch versions in
worker_svc/model/layers.py launch a kernel (and a temporary) per operator. They compute in
float32 and round only where the torch path does, so they match it to rounding. Loads are
widened to float32 at once and results narrowed just before stores: besides being the
precision wanted, the interpreter cannot do arithmetic on bfloat16 values (numpy has no
such type) and gives garbage if asked to.
"""
from __future__ import annotations

import torch

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before triton: it picks the interpreter where there is no CUDA)

# isort: split
import triton
import triton.language as tl

# Columns one silu_and_mul program covers: enough per program to hide latency on a GPU,
# few enough that a decode step's handful of rows still spreads over many programs.
_SILU_BLOCK = 1024


def _num_warps(block: int) -> int:
    # About 8 elements a thread for a row-sized block, within the 1-8 warps a row program wants.
    return min(max(block // 256, 1), 8)


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_row_stride, residual_ptr, residual_row_stride, weight_ptr, out_ptr, sum_ptr, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # The stream is rounded to the model dtype, as torch's `hidden + attn` rounds it,
        # and that rounded sum is what gets normalized.
        summed = (x + residual).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / D
    # RMSNorm casts the normalized row back to the input dtype before the weight multiplies it.
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, D] (layers.RMSNorm's semantics). With `residual` [T, D], the norm of
    s = x + residual instead, returned with s: (norm(s), s), the add and the norm in one pass."""
    num_rows, width = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(num_rows,)](
        x, x.stride(0), residual, residual.stride(0) if residual is not None else 0, weight, out, summed, eps,
        D=width, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
    )
    return out if summed is None else (out, summed)


@triton.jit
def _rotate_heads(
    ptr, head_stride, cols, col_mask, cos, sin,
    NUM_HEADS: tl.constexpr, HEADS_BLOCK: tl.constexpr, HALF: tl.constexpr,
):
    # rotate_half: out = x * cos + cat(-x2, x1) * sin, written half by half.
    heads = tl.arange(0, HEADS_BLOCK)
    mask = (heads < NUM_HEADS)[:, None] & col_mask[None, :]
    first = ptr + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, q_token_stride, q_head_stride, k_ptr, k_token_stride, k_head_stride,
    positions_ptr, cos_ptr, sin_ptr, table_row_stride,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    Q_HEADS_BLOCK: tl.constexpr, K_HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_BLOCK)
    col_mask = cols < HALF
    # The tables repeat their first half (cat(freqs, freqs)): one half serves both of a head's halves.
    cos = tl.load(cos_ptr + position * table_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * table_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, cols, col_mask, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_BLOCK, HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, cols, col_mask, cos, sin,
                  NUM_K_HEADS, K_HEADS_BLOCK, HALF)


def rotary_(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Neox-style rotary embedding of query [T, H, D] and key [T, KH, D], in place, at
    `positions` [T] of the full tables cos and sin [max_positions, D] (RotaryEmbedding's).

    The rows are looked up here, so no per-step [T, D] tables are built, and query and key
    may be views with any token and head strides (the split of a fused qkv projection)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim and query.stride(2) == 1 and key.stride(2) == 1
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.shape[1] == head_dim
    half = head_dim // 2
    q_heads, k_heads, half_block = (triton.next_power_of_2(n) for n in (num_heads, num_kv_heads, half))
    _rotary_kernel[(num_tokens,)](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1),
        positions, cos, sin, cos.stride(0),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=num_kv_heads, HALF=half,
        Q_HEADS_BLOCK=q_heads, K_HEADS_BLOCK=k_heads, HALF_BLOCK=half_block,
        num_warps=_num_warps(q_heads * half_block),
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_row_stride, out_ptr, INNER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INNER
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + INNER + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * INNER + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]: the gated MLP's activation on its fused gate/up projection."""
    num_rows, width = x.shape
    assert x.stride(1) == 1 and width % 2 == 0
    inner = width // 2
    out = torch.empty((num_rows, inner), dtype=x.dtype, device=x.device)
    block = min(_SILU_BLOCK, triton.next_power_of_2(inner))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inner, block))](
        x, x.stride(0), out, INNER=inner, BLOCK=block, num_warps=_num_warps(block),
    )
    return out
