"""A linear layer over 4-bit GGUF weights kept as stored (--quantization gguf, on CPU).

Where AVX-512 VNNI runs, every step takes the int16 x 4-bit kernel (kernels/cpu/vnni_gemm.py):
activations quantized per block of 32 inputs to int16 (about 1e-5 relative error), the
4-bit codes multiplied as stored. It was the fastest at every step size measured
(benchmarks/quantized_weights.py, all 120 projections of SmolLM2-135M, 2 threads, an
AMD EPYC with AVX-512 VNNI, load average 0.9, all kernels side by side in one run), and it
keeps nothing else: no float32 copy, no scratch buffer:

  rows                          1    4   16   32   64  256  1024
  int16 x 4-bit kernel, ms    3.6  5.8   14   20   31  107   443
  float32 4-bit kernel, ms    8.1   12   32   54   98  395  2135
  dequantize + float32 GEMM    20   26   29   37   57  175   594
  dense float32 (oneDNN), ms   19   17   22   28   44  128   510

Elsewhere, on the 2-core AVX2 CPU measured before it:

  rows                          1    8   16   32   48   64   96  128  256
  kvfleet's 4-bit kernel, ms   17   40   92  181  271  476  534  754 1462
  torch int4 (bfloat16), ms    29   65  105  261  366  472  849 1094 1141
  dequantize + float32 GEMM    67  108  156  187  244  342  504  530  856

there, steps of up to KERNEL_MAX_ROWS rows take kvfleet's float32 kernel
(kernels/cpu/q4_gemm.py): it reads the 4-bit codes and float16 scales (0.625 bytes a
weight) and computes in float32 over exactly the GGUF weights, so its tokens are the
float32 model's. Decode steps of up to INT16_MAX_ROWS rows take the AVX2 int16 kernel
(kernels/cpu/int16_gemm.py) over the same packing instead: activations quantized as the
VNNI kernel's are, the codes widened only to int16. One token's 120 projections, 2
threads in a decode step (int16; the float32 kernel runs on the step's one), load
average 4.4, so noisy:

  rows                          1    2    3    4    6    8
  int16 kernel, ms             15   18   23   30   32   57
  float32 4-bit kernel, ms     20   22   27   29   36   47

(on one thread each, 1 row: 11 against 16 ms). Single requests decoding alone kept all
384 greedy positions of the parity prompts.
Bigger steps take the float32 GEMM over weights the kernel dequantizes into a scratch
buffer, one layer at a time (21 ms a step for all layers; torch's dequantization of the
blocks took 58). Two more runs at 16-64 rows: the kernel 81 and 95 ms against 116 and
129 at 16 rows, level at 24 and 32, behind from 48; KERNEL_MAX_ROWS takes the lower tie.

Where neither kernel can build (no compiler, no AVX2/FMA/F16C), steps of up to
INT4_MAX_ROWS take torch's int4 weight-only matmul: bfloat16 activations, scales and
output (about 2e-3 relative error each), which kept 80% of the parity prompts' greedy
positions before their first divergence from the float32 oracle (--dtype bfloat16 keeps
61%; the int16 kernel and the float32 ones keep 100%)."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.kernels.cpu import int16_gemm, q4_gemm, vnni_gemm
from worker_svc.kernels.cpu.vnni_gemm import Q4Panels
from worker_svc.model.layers import RMSNorm, cpu_linear

KERNEL_MAX_ROWS = 24  # steps of at most this many rows take the float32 4-bit kernel, where it built
INT16_MAX_ROWS = 3  # of those, steps of at most this many take the AVX2 int16 kernel, where it built
INT4_MAX_ROWS = 32  # without it, steps of at most this many rows take torch's int4 kernel


class DequantScratch:
    """One buffer, as large as the largest layer, for whichever layer runs now: layers run one after another."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.buffer = torch.empty(0, dtype=dtype)

    def reserve(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=self.buffer.dtype)
        return self.buffer


class Q4Linear(nn.Module):
    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None, scratch: DequantScratch) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.scratch = scratch
        self.vnni = vnni_gemm.load()
        self.panels = None if self.vnni is None else Q4Panels.from_blocks(blocks)
        self.int4_weight: torch.Tensor | None = None
        self.int4_scale_zeros: torch.Tensor | None = None
        if self.panels is not None:  # every step takes it: nothing else is kept
            self.kernel = self.packed = self.blocks = self.int16 = None
            return
        scratch.reserve(blocks.codes.numel())
        self.kernel = q4_gemm.load()
        self.packed = None if self.kernel is None else q4_gemm.PackedQ4.from_blocks(blocks)
        self.int16 = None if self.packed is None else int16_gemm.load()  # reads the same packing
        # The kernel also dequantizes its packing for big steps, 2.8x faster than torch's passes over the
        # blocks (21 vs 58 ms for SmolLM2's 120 projections), so their 1.25 bytes a weight are not kept.
        self.blocks = None if self.packed is not None and scratch.buffer.dtype == torch.float32 else blocks
        # torch's int4 weights only where the float32 kernel cannot run: they would cost another 0.56 bytes a weight.
        if self.packed is None:
            self.pack_int4()

    def pack_int4(self) -> None:
        # The int4 kernel's dequantization is (code - 8) * scale + zero, per group of GROUP_SIZE inputs.
        blocks = self.blocks if self.blocks is not None else self.packed.to_blocks()
        self.int4_weight = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 1)
        scale_zeros = torch.stack((blocks.scales, blocks.offsets + 8 * blocks.scales), dim=-1)  # [rows, groups, 2]
        self.int4_scale_zeros = scale_zeros.transpose(0, 1).to(torch.bfloat16).contiguous()  # [groups, rows, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.int16 is not None and rows.shape[0] <= INT16_MAX_ROWS:
            out = self.int16.q4_linear(self.packed, rows.float(), self._float_bias()).to(rows.dtype)
        elif self.panels is not None or (self.packed is not None and rows.shape[0] <= KERNEL_MAX_ROWS):
            out = self.kernel_matmul(rows)
        elif self.packed is None and rows.shape[0] <= INT4_MAX_ROWS:
            out = self.int4_matmul(rows)
        else:
            out = self.dequantized_matmul(rows)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def quantizes_activations(self) -> bool:
        """Whether its kernel quantizes the activations as it reads them (the int16 one), and so
        computes the norm or activation before it there: add_norm_forward, silu_and_mul_forward."""
        return self.panels is not None

    def add_norm_forward(self, norm: RMSNorm, x: torch.Tensor,
                         residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h)), h) for h = residual + x, or x without a residual; float32 [rows, in]."""
        return self.vnni.add_norm_linear(self.panels, x, residual, norm.weight, norm.eps, self._float_bias())

    def silu_and_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [rows, 2 in] = [gate | up] float32."""
        return self.vnni.silu_and_mul_linear(self.panels, gate_up, self._float_bias())

    def kernel_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """Through whichever of kvfleet's kernels this layer keeps its weights for: the int16 one's
        panels, else the float32 one's packing."""
        kernel, weights = (self.vnni, self.panels) if self.panels is not None else (self.kernel, self.packed)
        assert kernel is not None and weights is not None
        return kernel.linear(weights, rows.float(), self._float_bias()).to(rows.dtype)

    def _float_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.float()

    def int4_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.int4_weight is None:  # a benchmark comparing both kernels
            self.pack_int4()
        out = torch._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.int4_weight, GROUP_SIZE,
                                                self.int4_scale_zeros).to(rows.dtype)
        if self.bias is not None:
            out += self.bias
        return out

    def dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        buffer = self.scratch.reserve(self.out_features * self.in_features)
        if self.blocks is None:
            weight = self.kernel.dequantize(self.packed, buffer)
        else:
            weight = self.blocks.dequantize(buffer)
        return cpu_linear(rows, weight, self.bias)
