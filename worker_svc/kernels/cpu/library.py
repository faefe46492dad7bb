"""The worker's C++ kernels (csrc/*.cpp): each built once
per machine with the system compiler into kvfleet's cache, keyed by its source, flags
and what they compile for, and loaded through ctypes, which releases the GIL for a call.

Not torch's JIT extension loader: it compiled for 50 s (torch's headers and pybind11),
needed ninja and Python's headers, and waits forever on a build lock that a killed build
leaves behind; here each build writes a private file and renames it into place, so
concurrent or interrupted builds never block one another. A kernel that cannot be built
(no compiler, a read-only cache, a CPU without its instructions) is None, with a logged
warning: every caller keeps a torch path, so serving never fails on a kernel.

Each kernel library links kvfleet's thread pool (csrc/thread_pool.cpp, built the same
way), so that all of them share its helper threads.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from services.file_cache import cache_root

logger = logging.getLogger(__name__)

# For kernels written with AVX2 intrinsics (the GGUF GEMMs).
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
# For kernels written for the CPU's vector width (AVX-512 where it has it, else AVX2): built
# for the machine itself, and again where the cache meets another CPU.
NATIVE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
POOL_SOURCE = Path(__file__).parent / "csrc" / "thread_pool.cpp"
POOL_FLAGS = ["-O2", "-pthread", "-shared", "-fPIC"]
# The element types a KV cache may have, with the name the kernels' entry points end in.
CACHE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def cpu_flags() -> set[str]:
    """The instruction set extensions /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.partition(":")[2].split())


def cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine.encode()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)})).encode()


def bind(function: ctypes._CFuncPtr, argtypes: list, restype: type | None = None) -> ctypes._CFuncPtr:
    """`function` declared with its argument and result types, as the kernels' callers do."""
    function.restype, function.argtypes = restype, argtypes
    return function


def pointer(tensor: torch.Tensor | None) -> int | None:
    """A kernel argument for an optional tensor (a bias, a residual): its data, or NULL."""
    return None if tensor is None else tensor.data_ptr()


def load_library(source: Path, flags: Sequence[str], what: str, needs: Sequence[str] = ()) -> ctypes.CDLL | None:
    """`source` built with `flags` (C++ for .cpp, else C), linked with the thread pool, and
    loaded; None, warned, where it cannot be. `needs`: CPU flags the code requires; `what`
    names it in the warnings."""
    if not set(needs) <= cpu_flags():
        logger.warning("%s: this CPU lacks one of %s; using torch instead", what, ", ".join(needs))
        return None
    pool = thread_pool()
    if pool is None:
        logger.warning("%s: the thread pool did not build; using torch instead", what)
        return None
    return _built(source, flags, what, [pool._name])


@functools.cache
def thread_pool() -> ctypes.CDLL | None:
    """The helper threads every kernel library shares (csrc/thread_pool.cpp)."""
    return _built(POOL_SOURCE, POOL_FLAGS, "the kernels' thread pool", [])


def _built(source: Path, flags: Sequence[str], what: str, libraries: Sequence[str]) -> ctypes.CDLL | None:
    native = "-march=native" in flags
    # The headers beside it, and the libraries it links, are part of what it compiles.
    code = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256(code + " ".join([*flags, *libraries]).encode() + (cpu_signature() if native else b""))
    library = cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        if not library.exists():
            compiler = shutil.which(os.environ.get("CXX", "c++") if source.suffix == ".cpp"
                                    else os.environ.get("CC", "cc"))
            if compiler is None:
                logger.warning("%s: no compiler to build it with; using torch instead", what)
                return None
            _build(compiler, source, flags, libraries, library, what)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as exc:  # a read-only cache, a broken toolchain
        detail = exc.stderr[-2000:] if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("%s did not build; using torch instead: %s", what, detail)
        return None


def _build(compiler: str, source: Path, flags: Sequence[str], libraries: Sequence[str], library: Path,
           what: str) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), *libraries], check=True,
                       capture_output=True, text=True)
        built.replace(library)  # atomic: a concurrent build never loads a half-written file
    logger.info("built %s in %.1f s: %s", what, time.perf_counter() - began, library)
