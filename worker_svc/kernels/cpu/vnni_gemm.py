"""GGUF blocks against int16 activations (csrc/vnni_gemm.cpp, AVX-512 VNNI), for every step
size: the 4-bit projections (Q4Linear) and the 8-bit LM head (Q8Linear).

Activations are quantized per row and block of 32 inputs to int16: the output is no
longer the float32 model's to the last bit (about 1e-5 relative), but it does not depend
on the batch: each row is quantized and summed on its own, in one order.

Built once per machine with the system C++ compiler and called through ctypes
(library.py). Without a compiler or AVX-512 VNNI, `load()` returns None with a logged
warning and both layers keep their float32 kernels. On a CPU with AMX-INT8 it is built a
second way, whose steps of 48 rows or more take the same integer dots on AMX tiles, scaled
in the same order: the same output to the bit. All 120 projections of SmolLM2-135M, 2
threads, a 2-core Sapphire Rapids-class Xeon (benchmarks/quantized_weights.py):

  rows                      32    48    64   256  1024
  with AMX tiles, ms      20.9  28.1  33.7   104   363
  AVX-512 VNNI alone, ms  20.3  30.8  37.2   126   425

(widening the 4-bit runs for the tiles cost what they saved at 16 and 32 rows); the
block-by-block scaling, in AVX-512 registers, is what the tiles wait for."""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from worker_svc.formats.q4_weights import GROUP_SIZE, Q4Blocks
from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu import library as kernel_library
from worker_svc.kernels.cpu.library import bind, load_library, pointer
from worker_svc.kernels.cpu.q4_gemm import PASSIVE_PARALLEL_MIN_MACS, call_threads, checked_call
from worker_svc.kernels.cpu.threads import idle_threads_sleep

SOURCE = Path(__file__).parent / "csrc" / "vnni_gemm.cpp"
# -ffp-contract=off: the fused norm and activation (csrc/quantized_rows.h) round as decoder_ops.cpp's do.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-ffp-contract=off", "-shared",
         "-fPIC"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
AMX_FLAGS = [*FLAGS, "-mamx-tile", "-mamx-int8", "-DKVFLEET_AMX"]
AMX_CPU_FLAGS = (*CPU_FLAGS, "amx_tile", "amx_int8")
PANEL_ROWS = 16  # output rows per panel: one per 32-bit lane of an AVX-512 register
# Quantizing x is a pass over it alone, a tenth of the products' time at most: it takes the
# call's threads only where that pays for waking them. Measured (1 thread / 2): 2048 x 576,
# 203 / 102 us; 2048 x 1536, 553 / 312 us; 256 x 576, 26 / 15 us (a wake-up costs ~40 us).
QUANTIZE_PARALLEL_MIN_ELEMENTS = 1 << 19

logger = logging.getLogger(__name__)


def _halves(values: torch.Tensor, panels: int, groups: int) -> torch.Tensor:
    """[rows, blocks] float16-exact values -> [panel, block, 32 bytes]: each block's 16 rows."""
    per_panel = values.view(panels, PANEL_ROWS, groups).transpose(1, 2).to(torch.float16)
    return per_panel.contiguous().view(torch.uint8)


def _code_sums(codes: torch.Tensor, panels: int, groups: int) -> torch.Tensor:
    """Each row's sum of a block's codes, [panel, block, 32 bytes] (int16): 128 times it is what
    the kernel's dots with the activations' high bytes, stored plus 128, count too much."""
    sums = codes.view(panels, PANEL_ROWS, groups, GROUP_SIZE).sum(-1, dtype=torch.int16)
    return sums.transpose(1, 2).contiguous().view(torch.uint8)


def _quads(codes: torch.Tensor, panels: int, groups: int) -> torch.Tensor:
    """[rows, cols] codes -> [panel, block, quad j, row, 4]: lane r's bytes of quad j are row
    r's inputs 4 j .. 4 j + 3."""
    return codes.view(panels, PANEL_ROWS, groups, GROUP_SIZE // 4, 4).permute(0, 2, 3, 1, 4)


def _tiles(rows: int, cols: int) -> bool:
    return rows % PANEL_ROWS == 0 and cols % GROUP_SIZE == 0


class Panels:
    """GGUF blocks in the kernel's layout, per panel of 16 output rows and block of 32 inputs
    ([out / 16, in / 32, block bytes] uint8), and the kernel function that reads them."""

    function: str

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int) -> None:
        self.panels = panels
        self.out_features, self.in_features = out_features, in_features


class Q4Panels(Panels):
    """Per block: 256 bytes of codes (chunk g: quad g in the low nibbles, quad g + 4 in the
    high ones), 16 float16 scales, 16 float16 offsets and 16 int16 code sums."""

    function = "q4_vnni_linear"

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks) -> Q4Panels | None:
        """None where the shape does not tile, or a scale or offset is not a float16."""
        rows, cols = blocks.shape
        pairs = torch.stack((blocks.scales, blocks.offsets))
        if not _tiles(rows, cols) or not torch.equal(pairs.to(torch.float16).float(), pairs):
            return None
        panels, groups = rows // PANEL_ROWS, cols // GROUP_SIZE
        quads = _quads(blocks.codes, panels, groups)
        nibbles = quads[:, :, :4] | (quads[:, :, 4:] << 4)
        chunks = nibbles.reshape(panels, groups, 4 * PANEL_ROWS * 4)
        scales, offsets = (_halves(values, panels, groups) for values in (blocks.scales, blocks.offsets))
        sums = _code_sums(blocks.codes, panels, groups)
        return cls(torch.cat((chunks, scales, offsets, sums), dim=-1).contiguous(), rows, cols)


class Q8Panels(Panels):
    """Per block: 512 bytes of codes (chunk j: quad j), 16 float16 scales and 16 int16 code sums."""

    function = "q8_vnni_linear"

    @classmethod
    def from_blocks(cls, blocks: Q8Blocks) -> Q8Panels | None:
        """None where the shape does not tile."""
        rows, cols = blocks.shape
        if not _tiles(rows, cols):
            return None
        panels, groups = rows // PANEL_ROWS, cols // GROUP_SIZE
        chunks = _quads(blocks.codes, panels, groups).reshape(panels, groups, 8 * PANEL_ROWS * 4).view(torch.uint8)
        sums = _code_sums(blocks.codes, panels, groups)
        return cls(torch.cat((chunks, _halves(blocks.scales, panels, groups), sums), dim=-1).contiguous(), rows,
                   cols)


class VnniKernel:
    def __init__(self, library: ctypes.CDLL, amx: bool) -> None:
        self.amx = amx  # whether its big steps take AMX tiles (vnni_gemm.cpp: kWidenRows rows or more)
        _i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        # x (or what it is made from) and its row stride, panels, bias, y, M, K, N, threads, quantize threads.
        gemm = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int]
        self._functions = {panels: bind(getattr(library, panels.function), gemm) for panels in (Q4Panels, Q8Panels)}
        self._silu_and_mul = bind(library.q4_vnni_linear_silu_and_mul, gemm)
        self._add_norm = bind(library.q4_vnni_linear_add_norm,
                               [_ptr, _ptr, _ptr, ctypes.c_float, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int])
        # As for the float32 kernel: waking a sleeping thread costs more than a small call.
        self.min_parallel_macs = PASSIVE_PARALLEL_MIN_MACS if idle_threads_sleep() else 0

    def linear(self, weights: Panels, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] float32 (rows may lie apart) -> x @ W.T + bias [rows, out] float32, x quantized
        to int16 per block (into the kernel's buffer: one call, one allocation, the output)."""
        x, threads = self._checked(x, bias, weights, rows_apart=True)
        out = torch.empty(x.shape[0], weights.out_features)
        self._functions[type(weights)](x.data_ptr(), x.stride(0), weights.panels.data_ptr(), pointer(bias),
                                       out.data_ptr(), *x.shape, weights.out_features, *threads)
        return out

    def silu_and_mul_linear(self, weights: Q4Panels, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """linear(silu(gate) * up) for gate_up [rows, 2 in] = [gate | up] float32 (rows may lie
        apart), the activation computed as it is quantized, never stored."""
        assert gate_up.dim() == 2 and gate_up.shape[1] == 2 * weights.in_features and gate_up.stride(1) == 1
        x, threads = self._checked(gate_up[:, : weights.in_features], bias, weights, rows_apart=True)
        out = torch.empty(x.shape[0], weights.out_features)
        self._silu_and_mul(x.data_ptr(), x.stride(0), weights.panels.data_ptr(), pointer(bias), out.data_ptr(),
                           *x.shape, weights.out_features, *threads)
        return out

    def add_norm_linear(self, weights: Q4Panels, x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(RMSNorm(h)), h) for h = x + residual, or h = x without one: x, residual [rows, in]
        float32; the norm computed as it is quantized, never stored."""
        x, threads = self._checked(x, bias, weights)
        assert norm_weight.dtype == torch.float32 and norm_weight.is_contiguous()
        assert norm_weight.numel() == weights.in_features
        out = torch.empty(x.shape[0], weights.out_features)
        summed = x
        if residual is not None:
            assert residual.dtype == torch.float32 and residual.shape == x.shape
            residual, summed = residual.contiguous(), torch.empty_like(x)
        self._add_norm(x.data_ptr(), pointer(residual), norm_weight.data_ptr(), eps, summed.data_ptr(),
                       weights.panels.data_ptr(), pointer(bias), out.data_ptr(), *x.shape, weights.out_features,
                       *threads)
        return out, summed

    def threads(self, rows: int, in_features: int, out_features: int) -> tuple[int, int]:
        """The threads a call of this size takes, and those of them that quantize its
        activations. In a decode step, every thread (decode_threads): one token's projections
        took 4.7 ms on one thread and 2.7 on two (benchmarks/roofline.py, a 2-core Sapphire
        Rapids-class Xeon), single-stream decode 98 against 144 tokens/s."""
        threads = call_threads(rows * in_features * out_features, self.min_parallel_macs, decode_gemm=True)
        return threads, threads if rows * in_features >= QUANTIZE_PARALLEL_MIN_ELEMENTS else 1

    def functions(self) -> dict[str, ctypes._CFuncPtr]:
        """The 4-bit entry points, by what they compute (for kernels/cpu/layer_loop.py)."""
        return {"add_norm_linear": self._add_norm, "linear": self._functions[Q4Panels],
                "silu_and_mul_linear": self._silu_and_mul}

    def _checked(self, x: torch.Tensor, bias: torch.Tensor | None, weights: Panels,
                 rows_apart: bool = False) -> tuple[torch.Tensor, tuple[int, int]]:
        """checked_call's x, and threads()."""
        x, _ = checked_call(x, bias, weights.in_features, weights.out_features, self.min_parallel_macs,
                            rows_apart=rows_apart)
        return x, self.threads(x.shape[0], weights.in_features, weights.out_features)


@functools.cache
def load() -> VnniKernel | None:
    """The kernel, built if this machine has not built it yet: with AMX where the CPU has it
    and Linux grants it; None where it cannot run (warned once)."""
    amx = _amx_library()
    if amx is not None:
        return VnniKernel(amx, amx=True)
    library = plain_library()
    return None if library is None else VnniKernel(library, amx=False)


def plain_library() -> ctypes.CDLL | None:
    """The kernel built without AMX (what load() gives where the CPU lacks it)."""
    return load_library(SOURCE, FLAGS, "the AVX-512 VNNI int16 GEMM kernel for GGUF blocks", needs=CPU_FLAGS)


def _amx_library() -> ctypes.CDLL | None:
    if not set(AMX_CPU_FLAGS) <= kernel_library.cpu_flags():
        return None
    library = load_library(SOURCE, AMX_FLAGS, "the AMX int16 GEMM kernel for GGUF blocks", needs=AMX_CPU_FLAGS)
    if library is None:
        return None
    if bind(library.vnni_amx_request, [], ctypes.c_int)() != 0:  # a kernel too old, or a signal stack too small
        logger.warning("Linux refused this process the AMX tiles; GGUF blocks take AVX-512 VNNI alone")
        return None
    return library
