"""Random batch layouts over a paged KV pool, for the attention kernels' tests."""
from __future__ import annotations

import torch

from worker_svc.attention.backend import BatchLayout


def random_layout(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int) -> BatchLayout:
    """Each request's blocks drawn at random from the pool (scattered, in no order), its new
    tokens' slots at the end of its context."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables = torch.randperm(num_blocks)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    slots = []
    for table, queries, length in zip(tables.tolist(), query_lens, seq_lens):
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(length - queries, length)]
    return BatchLayout(torch.tensor(query_lens), torch.tensor(seq_lens), tables, torch.tensor(slots), block_size,
                       max(query_lens))
