"""The KV block pool: a free list and a reference count per block.

Blocks are shared by reference count (parallel samples, cached prefixes); a block
returns to the free list when its last holder lets go.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        for block in block_ids:
            assert self._ref_counts[block] > 0, f"block {block} is not allocated"
            self._ref_counts[block] += 1

    def free(self, block_ids: list[int]) -> None:
        # Reversed so a request's tail blocks come back last and are reused last.
        for block in reversed(block_ids):
            count = self._ref_counts[block]
            assert count > 0, f"block {block} freed twice"
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)
