"""The LM head over 8-bit GGUF weights kept as stored (--quantization gguf, on CPU): the
token embedding's Q8_0 blocks, which a tied head shares, so neither is ever float32.

Measured on this 2-core AVX2 CPU (SmolLM2-135M's 49152 x 576 head, 2 threads): the
float32 kernel of csrc/q8_gemm.cpp reads a quarter of the float32 weight's bytes and
took 7 against 12 ms for one row, 9 against 24 for 4 and 13 against 23-47 for 8, and
fell behind oneDNN's float32 GEMM from about 16 rows. Bigger steps dequantize the head
a slice of rows at a time into the model's shared scratch buffer and run oneDNN's GEMM
on each slice, so no float32 copy of the whole head is ever held.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from worker_svc.layers import cpu_linear
from worker_svc.native import AVX2_CPU_FLAGS, AVX2_FLAGS, load_library
from worker_svc.q8_weights import Q8Blocks
from worker_svc.quantized_linear import DequantScratch

SOURCE = Path(__file__).parent / "csrc" / "q8_gemm.cpp"
KERNEL_MAX_ROWS = 12  # steps of at most this many rows take the 8-bit kernel
DEQUANTIZED_ROWS = 4096  # output rows dequantized at a time on the big-step path


class Q8Linear(nn.Module):
    def __init__(self, blocks: Q8Blocks, scratch: DequantScratch, kernel: Q8Kernel | None) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.blocks = blocks
        self.scratch = scratch
        self.kernel = kernel  # None where it could not be built: every step dequantizes
        scratch.reserve(min(DEQUANTIZED_ROWS, self.out_features) * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.linear(self.blocks, rows.to(torch.float32).contiguous()).to(x.dtype)
        else:
            out = self.dequantized_matmul(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], self.out_features)
        buffer = self.scratch.reserve(min(DEQUANTIZED_ROWS, self.out_features) * self.in_features)
        for start in range(0, self.out_features, DEQUANTIZED_ROWS):
            stop = min(start + DEQUANTIZED_ROWS, self.out_features)
            weight = self.blocks.dequantize(start, stop, buffer).to(rows.dtype)
            out[:, start:stop] = cpu_linear(rows, weight, None)
        return out


class Q8Kernel:
    """csrc/q8_gemm.cpp through ctypes."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.q8_linear
        self._function.restype = None
        self._function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]

    def linear(self, blocks: Q8Blocks, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32, contiguous -> x @ W.T [rows, out] float32."""
        rows, cols = x.shape
        out = torch.empty(rows, blocks.shape[0])
        self._function(x.data_ptr(), blocks.codes.data_ptr(), blocks.scales.data_ptr(), out.data_ptr(), rows, cols,
                       blocks.shape[0], torch.get_num_threads())
        return out


@functools.cache
def load_kernel() -> Q8Kernel | None:
    library = load_library(SOURCE, AVX2_FLAGS, "the 8-bit GEMM kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else Q8Kernel(library)
