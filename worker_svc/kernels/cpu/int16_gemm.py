"""GGUF blocks against int16 activations on AVX2 (csrc/int16_gemm.cpp), for steps of few
rows where AVX-512 VNNI does not run: the 4-bit projections (Q4Linear) and the 8-bit LM
head (Q8Linear), read in the float32 kernels' layouts (PackedQ4, Q8Blocks).

Activations are quantized per row and block of 32 inputs to int16, as vnni_gemm.py's are
(about 1e-5 relative error); each row is quantized and summed on its own, so the output
does not depend on the batch.

Built once per machine with the system C++ compiler and called through ctypes
(library.py). Without a compiler or AVX2/FMA/F16C, `load()` returns None with a logged
warning and both layers keep their float32 kernels."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, bind, load_library, pointer
from worker_svc.kernels.cpu.q4_gemm import PASSIVE_PARALLEL_MIN_MACS, PackedQ4, call_threads, checked_call
from worker_svc.kernels.cpu.threads import idle_threads_sleep

SOURCE = Path(__file__).parent / "csrc" / "int16_gemm.cpp"


class Int16Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        _i64, _ptr = ctypes.c_int64, ctypes.c_void_p
        # x and its row stride, codes, scales (and offsets), [bias,] y, M, K, N, threads.
        self.q4_function = bind(library.q4_int16_linear, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                                          ctypes.c_int])
        self.q8_function = bind(library.q8_int16_linear, [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                                                          ctypes.c_int])
        # As for the float32 kernel: waking a sleeping thread costs more than a small call (but
        # in a decode step the pool's helpers poll, and every call takes decode_threads()).
        self.min_parallel_macs = PASSIVE_PARALLEL_MIN_MACS if idle_threads_sleep() else 0

    def threads(self, rows: int, in_features: int, out_features: int) -> int:
        """The threads a call of this size takes; in a decode step, every thread (decode_threads)."""
        return call_threads(rows * in_features * out_features, self.min_parallel_macs, decode_gemm=True)

    def q4_linear(self, packed: PackedQ4, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] float32 (rows may lie apart) -> x @ W.T + bias [rows, out] float32."""
        x, _ = checked_call(x, bias, packed.in_features, packed.out_features, self.min_parallel_macs, rows_apart=True)
        threads = self.threads(x.shape[0], packed.in_features, packed.out_features)
        out = torch.empty(x.shape[0], packed.out_features)
        self.q4_function(x.data_ptr(), x.stride(0), packed.codes.data_ptr(), packed.scale_offsets.data_ptr(),
                         pointer(bias), out.data_ptr(), *x.shape, packed.out_features, threads)
        return out

    def q8_linear(self, blocks: Q8Blocks, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 (rows may lie apart) -> x @ W.T [rows, out] float32."""
        rows, cols = blocks.shape
        x, _ = checked_call(x, None, cols, rows, self.min_parallel_macs, rows_apart=True)
        threads = self.threads(x.shape[0], cols, rows)
        out = torch.empty(x.shape[0], rows)
        self.q8_function(x.data_ptr(), x.stride(0), blocks.codes.data_ptr(), blocks.scales.data_ptr(),
                         out.data_ptr(), *x.shape, rows, threads)
        return out


@functools.cache
def load() -> Int16Kernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot run (warned once)."""
    library = load_library(SOURCE, AVX2_FLAGS, "the AVX2 int16 GEMM kernel for GGUF blocks", needs=AVX2_CPU_FLAGS)
    return None if library is None else Int16Kernel(library)
