"""The prefix cache's changes as vLLM's engine protocol streams them (SubscribeKvEvents):
one KvEventBatch per step that changed the cache, numbered from 1, the latest kept so
a subscriber that reconnects resumes from a sequence number without a gap.

It stands where the step loop publishes KV events (OutputHub.kv_events) and passes
every batch on to the publisher that was there (NATS), when there was one: that one
numbers the batches and keeps the mirror for snapshots, else a KvMirror of its own does.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

from smg_grpc_proto.generated import common_pb2 as smg

from scheduler_svc.block_pool import KvEvents
from scheduler_svc.kv_mirror import KvEventSink, KvMirror
from services.kv_block_files import DISK, HOST, SHARED
from services.scheduler_messages import KvSnapshotResponse

# Batches kept for resuming subscribers: a few minutes of a busy engine's steps.
REPLAY_BATCHES = 4096


_TIERS = {HOST: smg.KV_CACHE_TIER_HOST, DISK: smg.KV_CACHE_TIER_DISK, SHARED: smg.KV_CACHE_TIER_EXTERNAL}


def block_hash_int64(block_hash: bytes) -> int:
    """kvfleet's block hashes are sha256 digests; the protocol carries int64: the first
    8 bytes, signed, as reproducible across processes as the digest itself."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def to_batch(seq: int, events: KvEvents) -> smg.KvEventBatch:
    batch = smg.KvEventBatch(sequence_number=seq, timestamp=time.time(), dp_rank=0)
    # The order a router applies them in, as KvEvents says: clear, remove, store.
    if events.cleared:
        batch.events.add(event_id=seq, cleared=smg.KvCacheCleared())
    if events.removed:
        batch.events.add(event_id=seq, removed=smg.KvBlocksRemoved(
            block_hashes=[block_hash_int64(h) for h in events.removed], tier=smg.KV_CACHE_TIER_DEVICE))
    for stored in stored_chains(events):
        batch.events.add(event_id=seq, stored=stored)
    for tier in events.tiers:  # the offload tiers' changes: hashes only (their tokens went with the device's)
        protocol_tier = _TIERS[tier.medium]
        if tier.removed:
            batch.events.add(event_id=seq, removed=smg.KvBlocksRemoved(
                block_hashes=[block_hash_int64(h) for h in tier.removed], tier=protocol_tier))
        if tier.stored:
            stored = smg.KvBlocksStored(tier=protocol_tier)
            for block_hash in tier.stored:
                stored.blocks.add(block_hash=block_hash_int64(block_hash))
            batch.events.add(event_id=seq, stored=stored)
    return batch


def stored_chains(events: KvEvents) -> list[smg.KvBlocksStored]:
    """The stored blocks as vLLM publishes them: one event per chain, each block the
    child of the one before it and the first the child of `parent_block_hash` (unset for
    a request's first block), with its tokens, the request's cache salt and adapter (its
    name on the chain, its id on each block). Hashes the pool was told nothing about go together, hash only."""
    chains: list[smg.KvBlocksStored] = []
    last, last_known = b"", False  # the hash before, and whether what it held is known
    for block_hash in events.stored:
        block = events.blocks.get(block_hash)
        follows = bool(chains) and (last_known and block.parent == last if block is not None else not last_known)
        if not follows:
            chains.append(smg.KvBlocksStored(tier=smg.KV_CACHE_TIER_DEVICE))
            if block is not None and block.parent is not None:
                chains[-1].parent_block_hash = block_hash_int64(block.parent)
            if block is not None and block.cache_salt is not None:
                chains[-1].cache_salt = block.cache_salt
            if block is not None and block.lora_name is not None:
                chains[-1].lora_name = block.lora_name
        if block is None:
            chains[-1].blocks.add(block_hash=block_hash_int64(block_hash))
        else:
            added = chains[-1].blocks.add(block_hash=block_hash_int64(block_hash), token_ids=block.token_ids,
                                          block_size=len(block.token_ids))
            if block.lora_id is not None:
                added.lora_id = block.lora_id
        last, last_known = block_hash, block is not None
    return chains


class KvEventStream:
    """Thread-safe: the step thread publishes, gRPC threads subscribe."""

    def __init__(self, inner: KvEventSink | None, max_batches: int = REPLAY_BATCHES) -> None:
        # Numbers the batches and keeps the mirror for KvSnapshot.
        self._inner: KvEventSink = inner if inner is not None else KvMirror()
        self._lock = threading.Lock()
        self._seq = 0  # the last batch held
        self._held: deque[smg.KvEventBatch] = deque(maxlen=max_batches)
        self._subscribers: list[queue.SimpleQueue[smg.KvEventBatch | None]] = []

    def publish(self, events: KvEvents) -> int:
        seq = self._inner.publish(events)
        batch = to_batch(seq, events)
        with self._lock:
            self._seq = seq
            self._held.append(batch)
            for subscriber in self._subscribers:
                subscriber.put(batch)
        return seq

    def snapshot(self) -> KvSnapshotResponse:
        return self._inner.snapshot()

    def subscribe(self, start: int) -> queue.SimpleQueue[smg.KvEventBatch | None] | None:
        """A queue with the batches numbered `start` on (0: from the next one), then
        every later one; None when batch `start` is no longer held."""
        subscriber: queue.SimpleQueue[smg.KvEventBatch | None] = queue.SimpleQueue()
        with self._lock:
            if start:
                oldest = self._held[0].sequence_number if self._held else self._seq + 1
                if start < oldest:
                    return None
                for batch in self._held:
                    if batch.sequence_number >= start:
                        subscriber.put(batch)
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: queue.SimpleQueue[smg.KvEventBatch | None]) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)
        subscriber.put(None)
