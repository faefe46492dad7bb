"""The in-place paged decode attention kernel (csrc/paged_decode.cpp), built and loaded on demand.

Built once per machine (library.py; AVX2 and FMA) and called through ctypes, with its
threads (the pool's) each running a share of the decodes that reads about the same number
of keys. Without a compiler or AVX2 (or with KVFLEET_DECODE_KERNEL=0) the CPU attention
backend keeps its gather-then-SDPA path, so this is an accelerator, never a requirement.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, AVX2_FLAGS, load_library
from worker_svc.kernels.cpu.paged_kernel import PagedKernel
from worker_svc.kernels.cpu.threads import even_shares

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@dataclass
class DecodeBatch:
    """A step's decode rows, as the kernel reads them (built once, used by every layer)."""

    rows: torch.Tensor  # [n] int64: row in the flattened batch
    seqs: torch.Tensor  # [n] int64: row in block_tables
    seq_lens: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, contiguous
    bounds: torch.Tensor  # [threads + 1] int64: thread i computes decodes [bounds[i], bounds[i + 1])


class PagedDecodeKernel(PagedKernel):
    entry_point = "paged_decode_attention"
    work_arrays = 3
    head_dim_multiple = 8

    def batch(self, rows: list[int], seqs: list[int], seq_lens: list[int], block_tables: torch.Tensor) -> DecodeBatch:
        return DecodeBatch(
            torch.tensor(rows, dtype=torch.int64), torch.tensor(seqs, dtype=torch.int64),
            torch.tensor(seq_lens, dtype=torch.int64), block_tables.to(torch.int64).contiguous(),
            torch.tensor(even_shares(seq_lens, torch.get_num_threads()), dtype=torch.int64),
        )

    def __call__(self, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch,
                 scale: float) -> None:
        """Writes attention of every decode row of `query` [T, H, D] (rows at any stride: a view
        of the fused QKV projection) into the same rows of `out`."""
        self._run(query, out, kv_cache, batch.block_tables, (batch.rows, batch.seqs, batch.seq_lens), batch.bounds,
                  scale)


@functools.cache
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot be."""
    library = load_library(SOURCE, AVX2_FLAGS, "the paged decode attention kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else PagedDecodeKernel(library)
