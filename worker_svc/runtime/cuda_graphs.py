"""Decode steps replayed from CUDA graphs, one captured per batch size of a ladder, and
with speculative decoding, verification steps too.

A decode step of a small model is mostly kernel launches from Python: replaying a
captured graph launches the whole forward at once. Inputs go through static buffers
the graphs were captured on; a batch runs in the smallest captured size that holds it,
its padding rows writing no KV (slot -1) and attending to nothing (length 0). A step
where every row decodes one token replays a graph of one row per request. With
speculative decoding (k drafts at most) a step where no request computes more than
1 + k tokens (a decode with its drafts, or a short prompt chunk) replays a graph of
1 + k rows per request, as vLLM's uniform-decode graphs: each request's rows are
padded at their end, and its length counts the padding, so its real rows sit at their
own positions and, attention being causal, never see the padding. Anything else, or
a batch larger than the ladder, runs eagerly. Graphs need a backend whose metadata is
views of the buffers, with shapes that do not depend on the data: the Triton backend
with a fixed block-table width and split count.

Without CUDA the same buffers and padding run eagerly instead of replaying, so the
static-buffer path is tested on CPU too.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker_svc.attention.backend import AttentionBackend, BatchLayout
from worker_svc.attention.gpu import TritonAttentionBackend

logger = logging.getLogger(__name__)

# What a model's forward takes before its positions, per row: a dtype and the shape of a row.
RowInputs = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
TOKEN_IDS: RowInputs = ((torch.long, ()),)  # a decoder's: one token id a row
Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class DecodeGraphs:
    def __init__(
        self, model: Callable[..., Outputs], backend: TritonAttentionBackend, kv_caches: list[torch.Tensor],
        sizes: tuple[int, ...], max_blocks: int, block_size: int, device: torch.device, spec_tokens: int = 0,
        inputs: RowInputs = TOKEN_IDS,
    ) -> None:
        """`model(*inputs, positions, kv_caches, metadata)` gives the rows' hidden states (or a
        tuple of such); `inputs` says what it takes before the positions (a decoder: token ids;
        an EAGLE head: embeddings and hidden states). `spec_tokens`: the drafts a request
        verifies at most (0: no speculative decoding)."""
        self.sizes = sorted(sizes)
        self.widths = (1, 1 + spec_tokens) if spec_tokens else (1,)
        rows = self.sizes[-1] * self.widths[-1]
        self.device = device
        with torch.device(device):
            self.inputs = [torch.zeros((rows, *shape), dtype=dtype) for dtype, shape in inputs]
            self.positions = torch.zeros(rows, dtype=torch.long)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.long)
            self.seq_lens = torch.zeros(self.sizes[-1], dtype=torch.int32)
            # A padding row may attend past a request's last block: its columns exist, and name real blocks.
            self.block_tables = torch.zeros((self.sizes[-1], max_blocks + -(-spec_tokens // block_size)),
                                            dtype=torch.int32)
        self.replays: dict[tuple[int, int], Callable[[], Outputs]] = {}
        started = time.perf_counter()
        pool = None
        for width in reversed(self.widths):  # largest first: the smaller graphs fit in its memory pool
            query_lens = torch.full((self.sizes[-1],), width, dtype=torch.int32, device=device)
            for size in reversed(self.sizes):
                layout = BatchLayout(query_lens[:size], self.seq_lens[:size], self.block_tables[:size],
                                     self.slot_mapping[:size * width], block_size, width)
                metadata = backend.build_metadata(layout)
                self.replays[size, width], pool = _capture(
                    lambda rows=size * width, metadata=metadata: model(
                        *(buffer[:rows] for buffer in self.inputs), self.positions[:rows], kv_caches, metadata
                    ),
                    device, pool,
                )
        if device.type == "cuda":
            logger.info("captured CUDA graphs for %d batch sizes (%s) of %s rows per request in %.1f s",
                        len(self.sizes), " ".join(map(str, self.sizes)), " and ".join(map(str, self.widths)),
                        time.perf_counter() - started)

    def forward(self, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor, layout: BatchLayout,
                row_starts: list[int]) -> Outputs | None:
        """The model's outputs from a replayed graph; None for a step graphs do not cover.
        `row_starts`: each request's first row."""
        requests, count = len(row_starts), len(positions)
        width = next((width for width in self.widths if width >= layout.max_query_len), None)
        if width is None or requests > self.sizes[-1]:
            return None
        size = next(size for size in self.sizes if size >= requests)
        self.seq_lens[:requests].copy_(layout.seq_lens)
        self.seq_lens[requests:size].fill_(0)
        self.block_tables[:requests, :layout.block_tables.shape[1]].copy_(layout.block_tables)
        if width == 1:
            rows: torch.Tensor | slice = slice(0, count)
            self.slot_mapping[count:size].fill_(-1)
        else:
            ends = [*row_starts[1:], count]
            padded = [request * width + row for request, (start, end) in enumerate(zip(row_starts, ends))
                      for row in range(end - start)]
            rows = torch.tensor(padded, dtype=torch.long).to(self.device, non_blocking=True)
            # Each request's length counts its padding rows, so its real rows keep their positions.
            self.seq_lens[:requests].add_(width - layout.query_lens.to(torch.int32))
            self.slot_mapping[:size * width].fill_(-1)
        for buffer, given in zip(self.inputs, inputs):
            buffer[rows] = given
        self.positions[rows] = positions
        self.slot_mapping[rows] = layout.slot_mapping
        out = self.replays[size, width]()
        return out[rows] if isinstance(out, torch.Tensor) else tuple(part[rows] for part in out)


def forward_rows(graphs: DecodeGraphs | None, model: Callable[..., Outputs], backend: AttentionBackend,
                 kv_caches: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], positions: torch.Tensor,
                 layout: BatchLayout, row_starts: list[int]) -> Outputs:
    """`model(*inputs, positions, kv_caches, metadata)` over a step's rows: replayed from
    `graphs` where one covers them, else run eagerly."""
    outputs = graphs.forward(inputs, positions, layout, row_starts) if graphs is not None else None
    return outputs if outputs is not None else model(*inputs, positions, kv_caches, backend.build_metadata(layout))


def _capture(run: Callable[[], Outputs], device: torch.device, pool: object) -> tuple[Callable[[], Outputs], object]:
    """A replay of `run`, and the memory pool the next (smaller) capture shares."""
    if device.type != "cuda":
        return run, pool
    run()  # Triton compiles its kernels, and torch sets up its workspaces, outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()

    def replay() -> Outputs:
        graph.replay()
        return out

    return replay, graph.pool()
