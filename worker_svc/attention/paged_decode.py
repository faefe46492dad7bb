"""The in-place paged decode attention kernel (csrc/paged_decode.cpp), built and loaded on demand.

Built once per machine (worker_svc/native.py; AVX2 and FMA) and called through ctypes,
which releases the GIL: each of torch's threads runs a share of the decodes, split so
that each share reads about the same number of keys. Without a compiler or AVX2 (or
with KVFLEET_DECODE_KERNEL=0) the torch backend keeps its gather-then-SDPA path, so
this is an accelerator, never a requirement.
"""
from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.native import AVX2_CPU_FLAGS, AVX2_FLAGS, load_library

SOURCE = Path(__file__).parents[1] / "csrc" / "paged_decode.cpp"

_i64, _f32p, _i64p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)


@dataclass
class DecodeBatch:
    """A step's decode rows, as the kernel reads them (built once, used by every layer)."""

    rows: torch.Tensor  # [n] int64: row in the flattened batch
    seqs: torch.Tensor  # [n] int64: row in block_tables
    seq_lens: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, contiguous
    # Per thread, the [first, last) range of decodes it computes.
    shares: list[tuple[int, int]]


class PagedDecodeKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.paged_decode_attention
        self._function.restype = None
        self._function.argtypes = [_f32p, _f32p, _f32p, _f32p, _i64p, _i64, _i64, _i64p, _i64p, _i64p,
                                   _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _i64]
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return dtype == torch.float32 and device.type == "cpu" and head_dim % 8 == 0

    def batch(self, rows: list[int], seqs: list[int], seq_lens: list[int], block_tables: torch.Tensor) -> DecodeBatch:
        threads = torch.get_num_threads()
        # Contiguous ranges of decodes with about equal keys each (a range ends at a decode boundary).
        total, shares, first, done = sum(seq_lens), [], 0, 0
        for index, length in enumerate(seq_lens):
            done += length
            if done * threads >= total * (len(shares) + 1) or index == len(seq_lens) - 1:
                shares.append((first, index + 1))
                first = index + 1
        return DecodeBatch(
            torch.tensor(rows, dtype=torch.int64), torch.tensor(seqs, dtype=torch.int64),
            torch.tensor(seq_lens, dtype=torch.int64), block_tables.to(torch.int64).contiguous(), shares,
        )

    def __call__(self, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch,
                 scale: float) -> None:
        """Writes attention of every decode row of `query` [T, H, D] (rows at any stride: a view
        of the fused QKV projection) into the same rows of `out`."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        assert query.stride()[1:] == (head_dim, 1)
        pointers = (
            ctypes.cast(query.data_ptr(), _f32p), _pointer(out, _f32p), _pointer(kv_cache[0], _f32p),
            _pointer(kv_cache[1], _f32p), _pointer(batch.block_tables, _i64p), batch.block_tables.shape[1],
            query.stride(0), _pointer(batch.rows, _i64p),
            _pointer(batch.seqs, _i64p), _pointer(batch.seq_lens, _i64p), num_heads, num_kv_heads, head_dim,
            block_size, scale,
        )
        # The first share on this thread, the others on the pool: one hand-off fewer a layer.
        first, *others = batch.shares
        if others and self._pool_size < len(others):
            self._pool = ThreadPoolExecutor(len(others), thread_name_prefix="kvfleet-decode-attn")
            self._pool_size = len(others)
        futures = [self._pool.submit(self._function, *pointers, *share) for share in others]
        self._function(*pointers, *first)
        for future in futures:
            future.result()


def _pointer(tensor: torch.Tensor, kind: type) -> ctypes._Pointer:
    assert tensor.is_contiguous()
    return ctypes.cast(tensor.data_ptr(), kind)


def decode_kernel_enabled() -> bool:
    """KVFLEET_DECODE_KERNEL=0 keeps decodes on the torch path (to compare, or to rule the kernel out)."""
    return os.environ.get("KVFLEET_DECODE_KERNEL", "1") != "0"


@functools.cache
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot be."""
    library = load_library(SOURCE, AVX2_FLAGS, "the paged decode attention kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else PagedDecodeKernel(library)
