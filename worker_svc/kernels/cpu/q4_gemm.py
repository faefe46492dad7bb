"""The float32 4-bit GEMM of csrc/q4_gemm.cpp (AVX2, FMA, F16C) for steps of few rows.

Built once per machine with the system C++ compiler (about 1.5 s) and called through
ctypes (library.py), as the other worker kernels are.

Without a compiler or AVX2/FMA/F16C, `load()` returns None with a logged warning and
Q4Linear keeps torch's int4 kernel: serving never fails on this kernel."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, bind, load_library, pointer
from worker_svc.kernels.cpu.threads import decode_threads, idle_threads_sleep

SOURCE = Path(__file__).parent / "csrc" / "q4_gemm.cpp"
# kvfleet's idle threads sleep (OMP_WAIT_POLICY=PASSIVE; the pool's between steps), and
# waking one cost ~0.2 ms a call on the 2-core VM measured: more than a whole 1-row
# projection (16 ms for SmolLM2's 120 projections on one thread, 35 ms on two). Under that
# policy a call of fewer multiply-adds runs on the calling thread alone; two threads only
# broke even at 16 rows (about this many) and won at 64 (220 vs 358 ms).
PASSIVE_PARALLEL_MIN_MACS = 16 << 20


def checked_call(x: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 min_parallel_macs: int, rows_apart: bool = False) -> tuple[torch.Tensor, int]:
    """x [rows, in] float32 made contiguous (with rows_apart, only each row: the kernel takes the
    row stride), and the threads a call of its size takes; bias [out] float32 or None. The
    kernels read raw pointers: a wrong shape or dtype must fail here."""
    rows, cols = x.shape
    assert x.dtype == torch.float32 and cols == in_features
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == out_features)
    x = x if rows_apart and x.stride(1) == 1 and x.stride(0) >= cols else x.contiguous()
    return x, call_threads(rows * cols * out_features, min_parallel_macs)


def call_threads(macs: int, min_parallel_macs: int, decode_gemm: bool = False) -> int:
    """The threads a kernel call of `macs` multiply-adds takes: torch's count from
    `min_parallel_macs` on, else the calling thread alone; for a decode GEMM (the int16
    kernels') in a step whose pool helpers poll, every thread (decode_threads)."""
    if decode_gemm and decode_threads():
        return decode_threads()
    return torch.get_num_threads() if macs >= min_parallel_macs else 1


class Q4Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._function = bind(library.q4_linear, [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int])
        self._dequantize = bind(library.q4_dequantize, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int])
        self.min_parallel_macs = PASSIVE_PARALLEL_MIN_MACS if idle_threads_sleep() else 0

    def linear(self, packed: PackedQ4, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] float32 -> x @ W.T + bias [rows, out] float32."""
        x, threads = checked_call(x, bias, packed.in_features, packed.out_features, self.min_parallel_macs)
        rows, cols = x.shape
        out = torch.empty(rows, packed.out_features)
        # ctypes releases the GIL for the call; the kernel splits output rows over `threads`.
        self._function(x.data_ptr(), packed.codes.data_ptr(), packed.scale_offsets.data_ptr(),
                       pointer(bias), out.data_ptr(), rows, cols, packed.out_features,
                       threads)
        return out


    def dequantize(self, packed: PackedQ4, out: torch.Tensor) -> torch.Tensor:
        """The float32 weights [out, in], written into `out` (at least out * in float32 elements)."""
        rows, cols = packed.out_features, packed.in_features
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() >= rows * cols
        self._dequantize(packed.codes.data_ptr(), packed.scale_offsets.data_ptr(), out.data_ptr(), rows, cols,
                         torch.get_num_threads())
        return out[: rows * cols].view(rows, cols)


@functools.cache
def load() -> Q4Kernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot run (warned once)."""
    library = load_library(SOURCE, AVX2_FLAGS, "the 4-bit GEMM kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else Q4Kernel(library)


class PackedQ4:
    """Q4Blocks laid out for the kernel: per block, 16 bytes of codes in GGUF's nibble order
    and a float16 (scale, offset) pair, which hold the GGUF values exactly (they were float16)."""

    def __init__(self, codes: torch.Tensor, scale_offsets: torch.Tensor) -> None:
        self.codes = codes  # [out, in / 32, 16] uint8
        self.scale_offsets = scale_offsets  # [out, in / 32, 2] float16
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * GROUP_SIZE

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks) -> PackedQ4 | None:
        """None where a scale or offset is not a float16 (a Q4_0 offset, -8 x scale, can overflow it)."""
        rows, cols = blocks.shape
        halves = blocks.codes.view(rows, cols // GROUP_SIZE, 2, GROUP_SIZE // 2)
        codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous()
        pairs = torch.stack((blocks.scales, blocks.offsets), dim=-1)
        scale_offsets = pairs.to(torch.float16).contiguous()
        if not torch.equal(scale_offsets.float(), pairs):
            return None
        return cls(codes, scale_offsets)

    def to_blocks(self) -> Q4Blocks:
        """The Q4Blocks these were packed from (for torch's int4 kernel, which a benchmark compares)."""
        rows = self.out_features
        codes = torch.stack((self.codes & 0x0F, self.codes >> 4), dim=2).reshape(rows, self.in_features)
        scales, offsets = self.scale_offsets.float().unbind(-1)
        return Q4Blocks(codes, scales.contiguous(), offsets.contiguous())
