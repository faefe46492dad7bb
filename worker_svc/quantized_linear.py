"""A linear layer over 4-bit GGUF weights kept as stored (--quantization gguf, on CPU).

Which kernel is fastest depends on the step's rows, measured on this 2-core AVX2 CPU
(benchmarks/quantized_weights.py, all 120 projections of SmolLM2-135M, 2 threads):
torch's int4 weight-only matmul with bfloat16 activations (its float32 and float16
paths were 15-25x slower) reads 1/8 of the float32 weights and ran 2x faster than the
float32 GEMM for one row (23 vs 45 ms), level at 8-16 rows, and its cost grows with
every row. Bigger steps take the float32 GEMM over weights dequantized into a scratch
buffer, one layer at a time: 1.1-2x slower than over float32 weights, its
dequantization costing 60-90 ms a step. Where int4 stops beating it was measured at
48 and at 256 rows in two runs; INT4_MAX_ROWS stays at the lower, more exact side.

Precision: the int4 kernel takes its scales and zeros in bfloat16 (rounding the GGUF
float16 scales: about 2e-3 relative error in the weights) and returns bfloat16
(another 2e-3): greedy tokens kept 80% of the parity prompts' positions before their
first divergence from the float32 oracle, where --dtype bfloat16 keeps 61%. Big steps
compute in float32 over exactly the GGUF weights."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers import cpu_linear
from worker_svc.q4_weights import GROUP_SIZE, Q4Blocks

INT4_MAX_ROWS = 32  # steps of at most this many rows take the int4 kernel


class DequantScratch:
    """One buffer, as large as the largest layer, for whichever layer runs now: layers run one after another."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.buffer = torch.empty(0, dtype=dtype)

    def reserve(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=self.buffer.dtype)
        return self.buffer


class QuantizedLinear(nn.Module):
    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, scratch: DequantScratch) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.blocks = blocks
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.scratch = scratch
        scratch.reserve(blocks.codes.numel())
        # The int4 kernel's dequantization is (code - 8) * scale + zero, per group of GROUP_SIZE inputs.
        self.int4_weight = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 1)
        scale_zeros = torch.stack((blocks.scales, blocks.offsets + 8 * blocks.scales), dim=-1)  # [rows, groups, 2]
        self.int4_scale_zeros = scale_zeros.transpose(0, 1).to(torch.bfloat16).contiguous()  # [groups, rows, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.int4_matmul(rows) if rows.shape[0] <= INT4_MAX_ROWS else self.dequantized_matmul(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def int4_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.int4_weight, GROUP_SIZE,
                                                self.int4_scale_zeros).to(rows.dtype)
        if self.bias is not None:
            out += self.bias
        return out

    def dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.blocks.dequantize(self.scratch.reserve(self.blocks.codes.numel()))
        return cpu_linear(rows, weight, self.bias)
