"""Decode steps replayed from CUDA graphs, one captured per batch size of a ladder.

A decode step of a small model is mostly kernel launches from Python: replaying a
captured graph launches the whole forward at once. Inputs go through static buffers
the graphs were captured on; a batch runs in the smallest captured size that holds it,
its padding rows writing no KV (slot -1) and attending to nothing (length 0). Only
steps where every row decodes one token replay; anything else, or a batch larger than
the ladder, runs eagerly. Graphs need a backend whose metadata is views of the
buffers, with shapes that do not depend on the data: the Triton backend with a fixed
block-table width and split count.

Without CUDA the same buffers and padding run eagerly instead of replaying, so the
static-buffer path is tested on CPU too.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker_svc.attention.backend import BatchLayout
from worker_svc.attention.gpu import TritonAttentionBackend
from worker_svc.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, backend: TritonAttentionBackend, kv_caches: list[torch.Tensor],
        sizes: tuple[int, ...], max_blocks: int, block_size: int, device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        largest = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(largest, dtype=torch.long)
            self.positions = torch.zeros(largest, dtype=torch.long)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.long)
            self.seq_lens = torch.zeros(largest, dtype=torch.int32)
            self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32)
            query_lens = torch.ones(largest, dtype=torch.int32)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in its memory pool
            layout = BatchLayout(query_lens[:size], self.seq_lens[:size], self.block_tables[:size],
                                 self.slot_mapping[:size], block_size, 1)
            metadata = backend.build_metadata(layout)
            self.replays[size], pool = _capture(
                lambda size=size, metadata=metadata: model(
                    self.input_ids[:size], self.positions[:size], kv_caches, metadata
                ),
                device, pool,
            )
        if device.type == "cuda":
            logger.info("captured decode CUDA graphs for %d batch sizes (%s) in %.1f s", len(self.sizes),
                        " ".join(map(str, self.sizes)), time.perf_counter() - started)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor | None:
        """The step's hidden states from a replayed graph; None for a step graphs do not cover."""
        count = len(input_ids)
        if layout.max_query_len != 1 or count > self.sizes[-1]:
            return None
        size = next(size for size in self.sizes if size >= count)
        width = layout.block_tables.shape[1]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        self.slot_mapping[:count].copy_(layout.slot_mapping)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(layout.seq_lens)
        self.seq_lens[count:size].fill_(0)
        self.block_tables[:count, :width].copy_(layout.block_tables)
        return self.replays[size]()[:count]


def _capture(
    run: Callable[[], torch.Tensor], device: torch.device, pool: object
) -> tuple[Callable[[], torch.Tensor], object]:
    """A replay of `run`, and the memory pool the next (smaller) capture shares."""
    if device.type != "cuda":
        return run, pool
    run()  # Triton compiles its kernels, and torch sets up its workspaces, outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, graph.pool()
