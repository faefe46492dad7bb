"""The scheduler's side of the KV connector (docs/kv_connector.md): which blocks of a
request to load from the offload tiers, and which computed blocks to save to them.

The scheduler owns block tables, so a load is only blocks that become computed without
a forward pass. It owns the host tier's table too (a BlockPool whose index maps a block
hash to a host block, its free queue the LRU order), and finds blocks in the file tiers
by their file names. The worker moves the bytes (worker_svc/runtime/kv_transfer.py): a
plan carries the loads and saves, a result the loads that finished.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from scheduler_svc.block_pool import BlockPool, KvEventLog
from scheduler_svc.request import Request
from services.histogram_counts import BucketCounter
from services.kv_block_files import HOST, BlockFiles
from services.kv_transfer_messages import RemoteBlocks
from services.messages import KvLoad, KvTierCounts, KvTierStats
from services.metric_buckets import KV_LOAD_SECONDS

FROM_FILES = -1  # a KvLoad block read from the file tiers, not the host tier
_REMEMBERED_FILE_SAVES = 65536  # hashes recently sent to the file tiers, not sent again


@dataclass
class Loading:
    """A request whose prefix is being loaded: its device blocks are the worker's to
    write until the load finishes, even if the request is aborted meanwhile."""

    request: Request
    num_device_hits: int  # leading blocks that were in the device pool already
    num_blocks: int  # the blocks asked of the tiers (or a producer) after them
    remote: bool = False  # fetched from a producer replica's worker (docs/disaggregation.md)
    started: float = field(default_factory=time.monotonic)


@dataclass
class TierTotals:
    """One tier's counters since start, for the engine's stats."""

    counts: KvTierCounts
    load_seconds: BucketCounter = field(default_factory=lambda: BucketCounter(KV_LOAD_SECONDS))

    def stats(self) -> KvTierStats:
        c = self.counts
        return KvTierStats(c.medium, c.stored_blocks, c.stored_bytes, c.loaded_blocks, c.loaded_bytes,
                           c.evicted_blocks, c.evicted_bytes, c.failed, self.load_seconds.snapshot())


class KvConnector:
    def __init__(self, num_host_blocks: int, files: list[BlockFiles]) -> None:
        self.host = BlockPool(num_host_blocks) if num_host_blocks else None
        self.files = files
        self.loading: dict[str, Loading] = {}
        self._host_saves: list[tuple[int, int]] = []
        self._file_saves: list[tuple[int, bytes]] = []
        self._sent_to_files: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0  # tokens looked up in the tiers (vllm:external_prefix_cache_queries)
        self.hits = 0  # tokens loaded from them (vllm:external_prefix_cache_hits)
        self.totals: dict[str, TierTotals] = {}
        self.events: KvEventLog | None = None

    def attach_events(self, events: KvEventLog) -> None:
        """Logs what the tiers gain and lose into the device pool's KV events: the host
        tier exactly (its table is here); the file tiers as saves are sent and as the
        worker reports evictions (another replica's evictions of a shared file go
        unseen: a router's hint that proves stale is a miss)."""
        self.events = events
        if self.host is not None:
            self.host.events = events.tier(HOST)

    def find(self, block_hashes: list[bytes], start: int, stop: int) -> list[int]:
        """For the blocks start..stop-1 of a chain, up to the first that no tier holds: the
        host block holding each, or FROM_FILES."""
        sources = []
        for block_hash in block_hashes[start:stop]:
            host_block = self.host.lookup([block_hash]) if self.host is not None else []
            if host_block:
                sources.append(host_block[0])
            elif any(tier.contains(block_hash) for tier in self.files):
                sources.append(FROM_FILES)
            else:
                break
        if self.host is not None:  # the blocks about to be read are the most recently used
            hits = [block for block in sources if block != FROM_FILES]
            self.host.share(hits)
            self.host.free(hits)
        return sources

    def start_load(self, request: Request, num_device_hits: int, sources: list[int],
                   remote: RemoteBlocks | None = None) -> KvLoad:
        """The request holds its device blocks already: hits, then those to load into.
        `remote`: the sources are a producer's blocks, fetched from its worker."""
        self.loading[request.request_id] = Loading(request, num_device_hits, len(sources), remote is not None)
        blocks = request.block_ids[num_device_hits:num_device_hits + len(sources)]
        hashes = request.block_hashes[num_device_hits:]
        return KvLoad(request.request_id, [(device, block_hash, source)
                                           for device, block_hash, source in zip(blocks, hashes, sources)], remote)

    def computed(self, block: int, block_hash: bytes) -> None:
        """A device block now holds this full block: save it to every tier lacking it."""
        if self.host is not None and not self.host.lookup([block_hash]):
            cached = self.host.num_cached_blocks
            [host_block] = self.host.allocate(1)  # every host block is unheld: the LRU one goes
            if self.host.num_cached_blocks < cached:
                self._total(HOST).counts.evicted_blocks += 1
            self.host.cache(host_block, block_hash)
            self.host.free([host_block])
            self._host_saves.append((block, host_block))
        if self.files and block_hash not in self._sent_to_files:
            self._sent_to_files[block_hash] = None
            if len(self._sent_to_files) > _REMEMBERED_FILE_SAVES:
                self._sent_to_files.popitem(last=False)
            self._file_saves.append((block, block_hash))
            if self.events is not None:
                for tier in self.files:
                    self.events.tier(tier.medium).changed(block_hash, True)

    def take_saves(self) -> tuple[list[tuple[int, int]], list[tuple[int, bytes]]]:
        saves = self._host_saves, self._file_saves
        self._host_saves, self._file_saves = [], []
        return saves

    def add_counts(self, counts: list[KvTierCounts]) -> None:
        for count in counts:
            totals = self._total(count.medium)
            for seconds in count.load_seconds:
                totals.load_seconds.observe(seconds)
            for block_hash in count.evicted_hashes:
                self._sent_to_files.pop(block_hash, None)
                if self.events is not None:
                    self.events.tier(count.medium).changed(block_hash, False)
            totals.counts.add(msgspec.structs.replace(count, load_seconds=[], evicted_hashes=[]))

    def stats(self) -> list[KvTierStats]:
        return [totals.stats() for totals in self.totals.values()]

    def _total(self, medium: str) -> TierTotals:
        if medium not in self.totals:
            self.totals[medium] = TierTotals(KvTierCounts(medium))
        return self.totals[medium]

    def forget(self) -> list[Loading]:
        """The worker is lost: no load will finish. Returns those that were under way."""
        loading = list(self.loading.values())
        self.loading.clear()
        self._host_saves.clear()
        self._file_saves.clear()
        self._sent_to_files.clear()
        if self.host is not None:
            self.host.reset_prefix_cache()
        return loading
