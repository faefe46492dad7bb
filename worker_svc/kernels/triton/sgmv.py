"""The LoRA shrink and expand as one Triton kernel: a matmul over segments of rows, each
segment with its own weight (punica's SGMV). Rows sorted by adapter come in contiguous
segments; segment i covers rows [starts[i], ends[i]) and multiplies them by weights[slots[i]]:

    out[r, n] = sum_k x[r, k] * weights[slot, n, k]

The shrink is this with the slots' A ([slots, R, in]), the expand with their B
([slots, out, R]). Accumulation is float32, with IEEE products (no TF32), so it matches
torch's matmul to rounding.
"""
from __future__ import annotations

import torch

import worker_svc.kernels.triton.interpreter  # noqa: F401  (before triton: it picks the interpreter where there is no CUDA)

# isort: split
import triton
import triton.language as tl

_BLOCK_M = 16  # rows: a decode step gives an adapter a few; tl.dot's least
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _segmented_mm_kernel(
    x_ptr, w_ptr, out_ptr, starts_ptr, ends_ptr, slots_ptr, N, K, stride_xm, stride_ws, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(starts_ptr + segment)
    end = tl.load(ends_ptr + segment)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < end
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_ws + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def segmented_mm(x: torch.Tensor, weights: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """x [rows, K] (rows contiguous) times each segment's weights[slot] [N, K] transposed;
    `segments`: (slot, start, end), covering every row of x once."""
    num_rows, depth = x.shape
    assert x.stride(1) == 1 and weights.stride(2) == 1, "rows must be contiguous"
    out = x.new_empty(num_rows, weights.shape[1])
    slots, starts, ends = (torch.tensor(column, dtype=torch.int32, device=x.device) for column in zip(*segments))
    longest = max(end - start for _, start, end in segments)
    grid = (len(segments), triton.cdiv(longest, _BLOCK_M), triton.cdiv(weights.shape[1], _BLOCK_N))
    _segmented_mm_kernel[grid](
        x, weights, out, starts, ends, slots, weights.shape[1], depth, x.stride(0), weights.stride(0),
        weights.stride(1), out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return out
