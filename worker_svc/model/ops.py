"""The decoder's elementwise work between its matmuls (norms, rotary embedding, the MLP's
activation), three ways: torch operator by operator (the reference, and any dtype),
fused Triton kernels (GPUs), and fused C++ kernels for float32 on CPU. A model takes
one ops object at construction (worker_svc/runtime/kernel_choice.py chooses it); the
layers pass the residual stream beside each sublayer's output, so that a fused norm adds
the two in the same pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels.cpu.decoder_ops import DecoderKernel
from worker_svc.kernels.triton import decoder_ops as triton_kernels
from worker_svc.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from worker_svc.model.q4_linear import Q4Linear

# The step's rotary inputs, made once for all layers: its cos and sin tables (TorchOps),
# or its positions and the whole tables, which the kernels index themselves.
Rope = tuple[torch.Tensor, ...]


class UnfusedLinears:
    """The norm or activation before a projection, then the projection: the ops whose kernels
    cannot compute them inside the projection's own."""

    def add_norm_linear(self, norm: RMSNorm, linear: nn.Module, x: torch.Tensor,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(h)), h) for h = residual + x, the residual stream from here on, or h = x
        without a residual (a stage's first layer)."""
        hidden, summed = (self.norm(norm, x), x) if residual is None else self.add_norm(norm, x, residual)
        return linear(hidden), summed

    def silu_and_mul_linear(self, linear: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        return linear(self.silu_and_mul(gate_up))


class TorchOps(UnfusedLinears):
    """The decoder's elementwise work in torch, operator by operator: the reference."""

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return rotary.tables(positions, dtype)

    def rotate(self, rope: Rope, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(rope, query, key)

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of residual + x, and that sum: the residual stream from here on."""
        hidden = residual + x
        return norm(hidden), hidden

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps(UnfusedLinears):
    """The same work in fused Triton kernels: one launch for each, where torch needs several."""

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return positions, rotary.cos, rotary.sin

    def rotate(self, rope: Rope, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos, sin = rope
        triton_kernels.rotary_(query, key, positions, cos, sin)
        return query, key

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels.rms_norm(x, norm.weight, norm.eps)

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_kernels.rms_norm(x, norm.weight, norm.eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_kernels.silu_and_mul(gate_up)


class CpuOps(UnfusedLinears):
    """The same work for a float32 model on CPU, one C++ pass each, on the calling thread
    for a decode step's few rows: torch's operators each woke the second OpenMP thread,
    which took a fifth of a 64-row decode step. Before a 4-bit projection whose kernel
    quantizes its input (Q4Linear.quantizes_activations), the norm and the activation
    are computed in that kernel as it quantizes, to the same bits, not in a pass of their own."""

    def __init__(self, kernel: DecoderKernel) -> None:
        self.kernel = kernel

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return positions, rotary.cos, rotary.sin

    def rotate(self, rope: Rope, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos, sin = rope
        self.kernel.rotary_(query, key, positions, cos, sin)
        return query, key

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.rms_norm(x, norm.weight, norm.eps)[0]

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel.rms_norm(x, norm.weight, norm.eps, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel.silu_and_mul(gate_up)

    def add_norm_linear(self, norm: RMSNorm, linear: nn.Module, x: torch.Tensor,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(linear, Q4Linear) and linear.quantizes_activations:
            return linear.add_norm_forward(norm, x, residual)
        return super().add_norm_linear(norm, linear, x, residual)

    def silu_and_mul_linear(self, linear: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        if isinstance(linear, Q4Linear) and linear.quantizes_activations:
            return linear.silu_and_mul_forward(gate_up)
        return super().silu_and_mul_linear(linear, gate_up)


Ops = TorchOps | TritonOps | CpuOps
