"""The in-place paged attention kernel for prompt chunks (csrc/paged_prefill.cpp), built and
loaded on demand.

Every chunk of a step, a whole prompt or one that continues cached context, runs in one
call per layer: its queries attend to keys and values where they lie in the cache, so a
chunk with context needs no gathered copy and no mask. Built once per machine
(library.py; AVX2 and FMA) and called through ctypes, with its threads (the pool's) each
taking a share of the tiles that reads about the same number of keys. It is built for the
CPU it runs on: a tile's rows fill three vectors, of 16 lanes with AVX-512, else 8. Without
a compiler or AVX2 (or with KVFLEET_PREFILL_KERNEL=0) the CPU backend keeps SDPA.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker_svc.kernels.cpu.library import AVX2_CPU_FLAGS, NATIVE_FLAGS, bind, load_library
from worker_svc.kernels.cpu.paged_kernel import PagedKernel
from worker_svc.kernels.cpu.threads import even_shares

SOURCE = Path(__file__).parent / "csrc" / "paged_prefill.cpp"


@dataclass
class PrefillChunk:
    """A run of query tokens of one sequence in the step's flattened batch."""

    first_row: int  # in the flattened batch
    num_tokens: int
    context: int  # keys the last token sees: cached ones and the chunk's own
    seq: int  # row in block_tables


@dataclass
class PrefillBatch:
    """A step's prompt chunks, as the kernel reads them (built once, used by every layer)."""

    chunks: list[PrefillChunk]
    chunk_table: torch.Tensor  # [n, 4] int64: the chunks' fields
    block_tables: torch.Tensor  # [B, max_blocks] int64, contiguous
    tile_rows: int  # rows (query token x query head) of a tile: the kernel's kRows
    # (num_heads, num_kv_heads) -> the tiles [m, 3] (chunk, kv head, first row) and each
    # thread's [first, last) of them: the first layer splits them, the others reuse it.
    _tiles: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (num_heads, num_kv_heads) not in self._tiles:
            self._tiles[num_heads, num_kv_heads] = self._split(num_heads // num_kv_heads, num_kv_heads)
        return self._tiles[num_heads, num_kv_heads]

    def _split(self, group: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        tiles, costs = [], []
        for index, chunk in enumerate(self.chunks):
            rows = chunk.num_tokens * group
            for kv_head in range(num_kv_heads):
                for first_row in range(0, rows, self.tile_rows):
                    last_token = (min(first_row + self.tile_rows, rows) - 1) // group
                    tiles.append((index, kv_head, first_row))
                    costs.append(chunk.context - chunk.num_tokens + last_token + 1)  # keys it reads
        # Contiguous shares (a tile's neighbours read its chunk's keys too, from cache).
        bounds = even_shares(costs, torch.get_num_threads())
        return torch.tensor(tiles, dtype=torch.int64), torch.tensor(bounds, dtype=torch.int64)


class PagedPrefillKernel(PagedKernel):
    entry_point = "paged_prefill_attention"
    work_arrays = 2
    head_dim_multiple = 4

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library)
        self.tile_rows = bind(library.paged_prefill_tile_rows, [], ctypes.c_int64)()

    def batch(self, chunks: list[PrefillChunk], block_tables: torch.Tensor) -> PrefillBatch:
        table = torch.tensor([(c.first_row, c.num_tokens, c.context, c.seq) for c in chunks], dtype=torch.int64)
        return PrefillBatch(chunks, table, block_tables.to(torch.int64).contiguous(), self.tile_rows)

    def __call__(self, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, batch: PrefillBatch,
                 scale: float) -> None:
        """Writes attention of every chunk row of `query` [T, H, D] (rows at any stride: a view
        of the fused QKV projection) into the same rows of `out`."""
        tiles, bounds = batch.tiles(query.shape[1], kv_cache.shape[3])
        self._run(query, out, kv_cache, batch.block_tables, (batch.chunk_table, tiles), bounds, scale)


@functools.cache
def load_kernel() -> PagedPrefillKernel | None:
    """The kernel, built if this machine has not built it yet; None where it cannot be."""
    library = load_library(SOURCE, NATIVE_FLAGS, "the paged prefill attention kernel", needs=AVX2_CPU_FLAGS)
    return None if library is None else PagedPrefillKernel(library)
