"""Random GGUF-quantized weights and the references the CPU GEMM kernels' tests hold them to."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.formats.q8_weights import Q8Blocks


def _normal(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> Q4Blocks:
    return Q4Blocks.from_gguf(quantize(_normal(rows, cols, seed), kind), kind)


def random_q8(rows: int, cols: int, seed: int = 0) -> Q8Blocks:
    return Q8Blocks.from_gguf(quantize(_normal(rows, cols, seed), GGMLQuantizationType.Q8_0))


def dense(blocks: Q4Blocks) -> torch.Tensor:
    return blocks.dequantize(torch.empty(blocks.codes.numel())).double()


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the int16 kernels read it: per row and block of 32, int16 values times amax / 32767."""
    grouped = x.reshape(x.shape[0], -1, GROUP_SIZE)
    scale = grouped.abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # float32, as the kernels'
    return (torch.round(grouped * inverse).double() * scale.double()).reshape(x.shape)
