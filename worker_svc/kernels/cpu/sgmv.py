"""LoRA's grouped shrink and expand of csrc/sgmv.cpp (AVX2, FMA) for a float32 model on
CPU: one call per fused projection adds every adapter's delta to the rows it serves,
reading only each adapter's rank and each part's block of the fused B (model/lora.py).

Built once per machine (library.py) and called through ctypes. Without a compiler or
AVX2/FMA, `load()` is None with a logged warning and the deltas stay torch matmuls;
KVFLEET_LORA_KERNEL=0 keeps them there on purpose (to compare)."""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, bind, load_library

SOURCE = Path(__file__).parent / "csrc" / "sgmv.cpp"

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class SgmvKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._add = bind(library.sgmv_add, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr] + [_i64] * 4
                         + [_int])

    def add_(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor,
             a: torch.Tensor, bt: torch.Tensor, part_ends: torch.Tensor) -> torch.Tensor:
        """out[rows[i]] += x[rows[i]] @ A[slot].T @ Bt[slot] for the rows of each segment, in place.
        x [T, in], out [T, out] float32 with contiguous rows; rows int64; segments int64
        [n, 4]: (slot, start, end, rank) over `rows`; a [slots, parts * R, in] and bt
        [slots, parts * R, out] contiguous; part_ends int64 [parts], each part's last output column + 1."""
        assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and bt.is_contiguous()
        parts = len(part_ends)
        self._add(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows.data_ptr(), segments.data_ptr(),
                  len(segments), a.data_ptr(), bt.data_ptr(), part_ends.data_ptr(), parts, a.shape[1] // parts,
                  a.shape[2], bt.shape[2], torch.get_num_threads())
        return out


@functools.cache
def load() -> SgmvKernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot run
    (warned once) or KVFLEET_LORA_KERNEL=0 asks for torch."""
    if os.environ.get("KVFLEET_LORA_KERNEL", "1") == "0":
        return None
    library = load_library(SOURCE, AVX2_FLAGS, "the LoRA SGMV kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else SgmvKernel(library)
