"""The float32 8-bit GEMM of csrc/q8_gemm.cpp (AVX2, FMA, F16C) over GGUF's Q8_0 blocks,
for the LM head's steps of few rows (model/q8_linear.py says when it runs).

Built once per machine with the system C++ compiler and called through ctypes
(library.py), as the other worker kernels are. Without a compiler or AVX2/FMA/F16C,
`load()` returns None with a logged warning and the head keeps its dense weights."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, bind, load_library

SOURCE = Path(__file__).parent / "csrc" / "q8_gemm.cpp"


class Q8Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = bind(library.q8_linear, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int])

    def linear(self, blocks: Q8Blocks, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32, contiguous -> x @ W.T [rows, out] float32."""
        rows, cols = x.shape
        out = torch.empty(rows, blocks.shape[0])
        self._function(x.data_ptr(), blocks.codes.data_ptr(), blocks.scales.data_ptr(), out.data_ptr(), rows, cols,
                       blocks.shape[0], torch.get_num_threads())
        return out


@functools.cache
def load() -> Q8Kernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot run (warned once)."""
    library = load_library(SOURCE, AVX2_FLAGS, "the 8-bit GEMM kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else Q8Kernel(library)
