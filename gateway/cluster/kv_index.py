"""Which scheduler replica holds which prefix: an index of every replica's cached block
hashes, kept from their KV events (NATS `kvfleet.kv.*`, scheduler_svc/kv_event_publisher.py).

Each replica's events are numbered; one that starts late here, or whose numbers jump
(NATS lost a message, or we reconnected), is reloaded from its snapshot
(Scheduler.KvSnapshot), and the events after it are applied on top. Every gateway
builds the same index from the same events, so gateways route alike without talking
to each other.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg

from gateway.cluster.routing import CachedPrefix
from services.kv_block_files import SHARED
from services.nats_link import NatsThread, kv_subject
from services.scheduler_messages import KvSnapshotResponse, NumberedKvEvents

logger = logging.getLogger(__name__)

# A replica's snapshot, or None when it cannot be had (the replica is gone).
Snapshot = Callable[[str], KvSnapshotResponse | None]
_decode_events = msgspec.msgpack.Decoder(NumberedKvEvents).decode


@dataclass
class ReplicaBlocks:
    """One replica's cached block hashes, as its numbered events build them."""

    seq: int = 0  # every event up to this number is applied
    hashes: set[bytes] = field(default_factory=set)
    tiers: dict[str, set[bytes]] = field(default_factory=dict)  # per offload tier (medium): what it holds
    held: dict[int, NumberedKvEvents] = field(default_factory=dict)  # after a gap, until a snapshot
    syncing: bool = False

    def receive(self, events: NumberedKvEvents) -> None:
        """Holds the events, and applies what is now in order (a gap waits for a snapshot)."""
        if events.seq > self.seq:
            self.held[events.seq] = events
        if not self.syncing:
            self.apply_held()

    def apply_held(self) -> None:
        while (events := self.held.pop(self.seq + 1, None)) is not None:
            if events.cleared:
                self.hashes.clear()
            self.hashes.difference_update(events.removed)
            self.hashes.update(events.stored)
            for tier in events.tiers:
                tier.apply_to(self.tiers.setdefault(tier.medium, set()))
            self.seq = events.seq
        for seq in [s for s in self.held if s <= self.seq]:
            del self.held[seq]


def cached_blocks(replicas: Mapping[str, ReplicaBlocks], block_hashes: Sequence[bytes]) -> dict[str, CachedPrefix]:
    """Per replica, the chain's leading blocks it holds. A block in the shared tier any
    replica wrote counts for every replica that has a shared tier: they mount one store."""
    shared = set().union(*(replica.tiers[SHARED] for replica in replicas.values() if SHARED in replica.tiers))
    counts = {}
    for instance_id, replica in replicas.items():
        device = 0
        while device < len(block_hashes) and block_hashes[device] in replica.hashes:
            device += 1
        tiers = [hashes for medium, hashes in replica.tiers.items() if medium != SHARED]
        if SHARED in replica.tiers:
            tiers.append(shared)
        end = device
        while end < len(block_hashes) and any(block_hashes[end] in hashes for hashes in tiers):
            end += 1
        counts[instance_id] = CachedPrefix(device, end - device)
    return counts


class KvIndex:
    def __init__(self, url: str, snapshot: Snapshot, connect_timeout_s: float = 10.0) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()  # the NATS thread applies, sync threads reload, routing reads
        self._replicas: dict[str, ReplicaBlocks] = {}
        self._nats = NatsThread(url, "kvfleet-kv-index", connect_timeout_s, reconnected_cb=self._on_reconnect)
        self._nats.run(self._subscribe(), connect_timeout_s)

    def close(self) -> None:
        self._nats.close()

    def sync(self, instance_id: str) -> None:
        """(Re)loads the replica from its snapshot, on a thread (a gRPC call)."""
        with self._lock:
            self._sync(instance_id, self._replicas.setdefault(instance_id, ReplicaBlocks()))

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._replicas.pop(instance_id, None)

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, CachedPrefix]:
        """Per replica, the chain's leading blocks it holds (in its device pool, then its tiers)."""
        with self._lock:
            return cached_blocks(self._replicas, block_hashes)

    async def _subscribe(self) -> None:
        await self._nats.nc.subscribe(kv_subject("*"), cb=self._on_message)
        await self._nats.nc.flush()

    async def _on_message(self, msg: Msg) -> None:
        events = _decode_events(msg.data)
        with self._lock:
            replica = self._replicas.get(events.scheduler_instance_id)
            if replica is None:  # a replica we have not synced yet: its snapshot first
                replica = self._replicas[events.scheduler_instance_id] = ReplicaBlocks()
                self._sync(events.scheduler_instance_id, replica)
            replica.receive(events)
            if replica.held and not replica.syncing:  # a gap: a message was lost
                self._sync(events.scheduler_instance_id, replica)

    async def _on_reconnect(self) -> None:
        """Events sent while we were away are lost: reload every replica."""
        with self._lock:
            for instance_id, replica in self._replicas.items():
                self._sync(instance_id, replica)

    def _sync(self, instance_id: str, replica: ReplicaBlocks) -> None:
        """Under the lock."""
        if not replica.syncing:
            replica.syncing = True
            threading.Thread(target=self._load, args=(instance_id, replica), name="kvfleet-kv-sync",
                             daemon=True).start()

    def _load(self, instance_id: str, replica: ReplicaBlocks) -> None:
        snapshot = self._snapshot(instance_id)
        with self._lock:
            replica.syncing = False
            if snapshot is None:  # gone: nothing to route to
                if self._replicas.get(instance_id) is replica:
                    del self._replicas[instance_id]
                return
            if snapshot.seq >= replica.seq:
                replica.seq, replica.hashes = snapshot.seq, set(snapshot.block_hashes)
                replica.tiers = {tier.medium: set(tier.stored) for tier in snapshot.tiers}
                logger.info("KV index: scheduler %s holds %d blocks (its snapshot at event %d)", instance_id,
                            len(replica.hashes), snapshot.seq)
            replica.apply_held()
            if replica.held:  # lost again since the snapshot
                logger.info("KV events of scheduler %s: a gap after %d; reloading", instance_id, replica.seq)
                self._sync(instance_id, replica)
