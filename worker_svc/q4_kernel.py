"""The float32 4-bit GEMM of csrc/q4_gemm.cpp (AVX2, FMA, F16C) for steps of few rows:
built on first use with torch's JIT extension loader into kvfleet's cache, keyed by the
source, the flags, torch and Python, so later processes load the built library at once.

Without a compiler or AVX2 the build is skipped or fails: `load()` then returns None
with a logged warning and callers keep torch's int4 kernel; serving never fails on it."""
from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from services.file_cache import cache_root
from worker_svc.q4_weights import GROUP_SIZE, Q4Blocks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "q4_gemm.cpp"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def cpu_supports_kernel() -> bool:
    """The instructions the kernel is compiled for, as /proc/cpuinfo lists them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return all(flag in flags.split() for flag in CPU_FLAGS)


def build_directory() -> Path:
    key = "|".join((SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, sys.version))
    return cache_root() / "kernels" / f"q4_gemm-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load() -> ModuleType | None:
    """The built extension, or None where it cannot run here (warned about once)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            _module = _build()
        return _module


def _build() -> ModuleType | None:
    if not cpu_supports_kernel():
        logger.warning("4-bit GEMM kernel: this CPU lacks one of %s; using torch's int4 kernel", CPU_FLAGS)
        return None
    from torch.utils import cpp_extension  # imports setuptools: only when building

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    try:
        module = cpp_extension.load(name=f"kvfleet_q4_gemm_{directory.name[-16:]}", sources=[str(SOURCE)],
                                    extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                    build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means: keep the int4 kernel
        logger.warning("4-bit GEMM kernel did not build (%s); using torch's int4 kernel", error)
        return None
    logger.info("4-bit GEMM kernel ready in %.1f s (%s)", time.perf_counter() - began, directory)
    return module


class PackedQ4:
    """Q4Blocks laid out for the kernel: per block, 16 bytes of codes in GGUF's nibble order
    and a float16 (scale, offset) pair, which hold the GGUF values exactly (they were float16)."""

    def __init__(self, codes: torch.Tensor, scale_offsets: torch.Tensor) -> None:
        self.codes = codes  # [rows, cols / 32, 16] uint8
        self.scale_offsets = scale_offsets  # [rows, cols / 32, 2] float16

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

    def linear(self, module: ModuleType, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, cols] float32 -> [rows, out] float32."""
        return module.q4_linear(x.contiguous(), self.codes, self.scale_offsets, bias)
