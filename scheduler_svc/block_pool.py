"""The KV block pool: ref counts, an LRU free queue and the prefix-cache index.

A block holding a full, hashed block of tokens stays indexed after its last holder
frees it: it sits in the free queue, evictable, and a later request with the same
prefix can take it back. Allocation takes from the front of the queue (least
recently freed), dropping the old hash. Requests free their blocks tail first, so
a prompt's shared head outlives its private tail.

With a KvEventLog attached, the pool also records what its index gained and lost, for
routers that place requests where their prefix is cached (KV events).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.scheduler_messages import TierEvents


class NoFreeBlocks(RuntimeError):
    pass


@dataclass(frozen=True)
class StoredBlock:
    """What a stored hash stands for (services/block_hash.py): the hash of the block
    before it (None for a request's first block), its tokens, the request's salt and adapter."""

    parent: bytes | None
    token_ids: list[int]
    cache_salt: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class KvEvents:
    """The index's net change over some steps: clear first if `cleared`, then drop
    `removed`, then add `stored`, in the order they were stored (a parent before its
    child). `blocks` describes the stored hashes the pool was told about. `tiers`: the
    same for each offload tier that changed (services/kv_block_files.py names them)."""

    cleared: bool
    removed: list[bytes]
    stored: list[bytes]
    blocks: Mapping[bytes, StoredBlock] = field(default_factory=dict)
    tiers: list[TierEvents] = field(default_factory=list)


class TierLog:
    """Each hash's last change since the last take: a hash stored and evicted within one
    step is one removal, which a router applies as a no-op. It takes a pool's event
    calls, so an offload tier's BlockPool (the host tier's) can log into one."""

    def __init__(self) -> None:
        self._last: dict[bytes, bool] = {}  # hash -> indexed now, in the order of last changes
        self._cleared = False

    def changed(self, block_hash: bytes, indexed: bool, stored: StoredBlock | None = None) -> None:
        self._last.pop(block_hash, None)
        self._last[block_hash] = indexed

    def clear(self) -> None:
        self._last.clear()
        self._cleared = True

    def take(self) -> tuple[bool, list[bytes], list[bytes]] | None:
        """(cleared, removed, stored) since the last take, or None when nothing changed."""
        if not self._last and not self._cleared:
            return None
        taken = (self._cleared, [h for h, indexed in self._last.items() if not indexed],
                 [h for h, indexed in self._last.items() if indexed])
        self._last, self._cleared = {}, False
        return taken


class KvEventLog:
    """The device pool's changes (and the offload tiers', by medium) since the last take."""

    def __init__(self) -> None:
        self._device = TierLog()
        self._blocks: dict[bytes, StoredBlock] = {}
        self._tiers: dict[str, TierLog] = {}

    def changed(self, block_hash: bytes, indexed: bool, stored: StoredBlock | None = None) -> None:
        self._device.changed(block_hash, indexed)
        if stored is not None:
            self._blocks[block_hash] = stored

    def clear(self) -> None:
        self._device.clear()
        self._blocks.clear()

    def tier(self, medium: str) -> TierLog:
        return self._tiers.setdefault(medium, TierLog())

    def take(self) -> KvEvents | None:
        tiers = [TierEvents(medium, *taken) for medium, log in self._tiers.items() if (taken := log.take())]
        device = self._device.take()
        if device is None and not tiers:
            return None
        cleared, removed, stored = device or (False, [], [])
        blocks = {h: self._blocks[h] for h in stored if h in self._blocks}
        self._blocks = {}
        return KvEvents(cleared, removed, stored, blocks, tiers)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.events: KvEventLog | None = None  # attached by whoever publishes them

    @property
    def num_free_blocks(self) -> int:
        """Unheld blocks, evictable cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Take another reference to each block, reviving evictable cached ones."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def free(self, block_ids: list[int]) -> None:
        for block in reversed(block_ids):
            count = self._ref_counts[block]
            assert count > 0, f"block {block} freed twice"
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `block_hashes`."""
        hits = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (sharing them uses up free space)."""
        return sum(1 for block in block_ids if self._ref_counts[block] == 0)

    def cache(self, block: int, block_hash: bytes, stored: StoredBlock | None = None) -> None:
        """Index a block that now holds the full block of tokens `block_hash` stands for
        (`stored` says which, for the KV events)."""
        if block_hash not in self._cached and self._block_hash[block] is None:
            self._cached[block_hash] = block
            self._block_hash[block] = block_hash
            if self.events is not None:
                self.events.changed(block_hash, True, stored)

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._block_hash[block] = None
        self._cached.clear()
        if self.events is not None:
            self.events.clear()

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hash[block] = None
            if self.events is not None:
                self.events.changed(block_hash, False)
