"""The scheduler's KV events on NATS (`kvfleet.kv.<instance_id>`): after each step that
changed the prefix cache, what it stored and evicted, numbered from 1, so routers keep
an index of which replica holds which prefix (gateway/cluster/kv_index.py).

Core NATS may lose a message; a router that sees a gap (or starts late) asks for a
snapshot (Scheduler.KvSnapshot), which comes from the KvMirror kept here: the hashes as
of the last numbered message, so snapshot and events always agree.
"""
from __future__ import annotations

import logging

from scheduler_svc.block_pool import KvEvents
from scheduler_svc.kv_mirror import KvMirror
from services.nats_link import NatsThread, kv_subject
from services.scheduler_messages import KvSnapshotResponse, NumberedKvEvents
from services.transport.rpc import encode

logger = logging.getLogger(__name__)


class KvEventPublisher:
    def __init__(self, nats: NatsThread, instance_id: str) -> None:
        self._nats = nats
        self._instance_id = instance_id
        self._mirror = KvMirror()

    def publish(self, events: KvEvents) -> int:
        """From the step thread; never waits on the network."""
        seq = self._mirror.apply(events)
        payload = encode(NumberedKvEvents(self._instance_id, seq, events.cleared, events.removed, events.stored,
                                            events.tiers))
        # FIFO on the NATS loop: messages leave in number order (one step thread publishes).
        self._nats.loop.call_soon_threadsafe(self._nats.loop.create_task, self._send(payload))
        return seq

    def snapshot(self) -> KvSnapshotResponse:
        return self._mirror.snapshot()

    async def _send(self, payload: bytes) -> None:
        try:
            await self._nats.nc.publish(kv_subject(self._instance_id), payload)
        except Exception as exc:  # routers see the gap and take a snapshot
            logger.warning("could not publish KV events: %r", exc)
