"""What the step loop publishes the prefix cache's changes to (OutputHub.kv_events), and
the mirror every such publisher keeps: the batches numbered from 1 and the block hashes
indexed as of the last number, so a snapshot (Scheduler.KvSnapshot) always agrees with
the numbers a router has seen.
"""
from __future__ import annotations

import threading
from typing import Protocol

from scheduler_svc.block_pool import KvEvents
from services.scheduler_messages import KvSnapshotResponse, TierEvents


class KvEventSink(Protocol):
    def publish(self, events: KvEvents) -> int:
        """Numbers one step's changes and passes them on; returns their number. From
        the step thread; never waits on the network."""
        ...

    def snapshot(self) -> KvSnapshotResponse:
        """The hashes indexed as of the last number, with that number."""
        ...


class KvMirror:
    """The index rebuilt from the numbered batches. Thread-safe: the step thread
    applies, gRPC threads take snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._hashes: set[bytes] = set()
        self._tiers: dict[str, set[bytes]] = {}

    def apply(self, events: KvEvents) -> int:
        """Applies the next batch in the order KvEvents documents; returns its number."""
        with self._lock:
            self._seq += 1
            if events.cleared:
                self._hashes.clear()
            self._hashes.difference_update(events.removed)
            self._hashes.update(events.stored)
            for tier in events.tiers:
                tier.apply_to(self._tiers.setdefault(tier.medium, set()))
            return self._seq

    def publish(self, events: KvEvents) -> int:
        """A KvEventSink that only keeps the mirror."""
        return self.apply(events)

    def snapshot(self) -> KvSnapshotResponse:
        with self._lock:
            tiers = [TierEvents(medium, stored=list(hashes)) for medium, hashes in self._tiers.items()]
            return KvSnapshotResponse(self._seq, list(self._hashes), tiers)
