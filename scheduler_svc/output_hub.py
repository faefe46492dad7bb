"""Fans each step's token deltas out to the open StreamOutputs of their gateway.

The step loop publishes one batch per gateway per step; each subscription is one
StreamOutputs call. This is the in-process stand-in for NATS subject
`kvfleet.out.<gateway_id>`: same batches, same fan-out to every subscriber.
"""
from __future__ import annotations

import queue
import threading
from collections import defaultdict

from scheduler_svc.kv_mirror import KvEventSink
from scheduler_svc.replay_window import ReplayWindow
from services.engine_client import EngineUnavailable
from services.messages import TokenDelta

_Batch = list[TokenDelta]


class Subscription:
    def __init__(self, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()  # None: the end
        self._ended = False  # read and written by the one reader thread only

    def put(self, batch: _Batch) -> None:
        self._queue.put(batch)

    def close(self) -> None:
        """Ends the subscription after what was put before; safe to call twice."""
        self._queue.put(None)

    def next_batch(self) -> _Batch | None:
        """Blocks for the next deltas; None once the subscription has ended. Whatever
        queued up while the reader was busy comes as one batch, in order, so a slow
        reader gets fewer, larger messages rather than a growing backlog of small ones."""
        if self._ended:
            return None
        batch: _Batch = []
        item = self._queue.get()
        while item is not None:
            batch.extend(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch
        self._ended = True
        return batch or None


class OutputHub:
    # What was published on NATS, for gateways that missed some (NatsOutputHub's);
    # StreamOutputs needs none: gRPC keeps a stream in order and whole.
    replay_window: ReplayWindow | None = None
    # Where the prefix cache's changes go for routers: NatsOutputHub's KvEventPublisher,
    # the engine protocol's KvEventStream (wrapping that one, if any); none in-process.
    kv_events: KvEventSink | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: defaultdict[str, list[Subscription]] = defaultdict(list)
        self._closed = False

    def subscribe(self, gateway_id: str) -> Subscription:
        subscription = Subscription(gateway_id)
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the scheduler is shutting down")
            self._subscriptions[gateway_id].append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            subscriptions = self._subscriptions.get(subscription.gateway_id, [])
            if subscription in subscriptions:
                subscriptions.remove(subscription)
            if not subscriptions:
                self._subscriptions.pop(subscription.gateway_id, None)

    def has_subscriber(self, gateway_id: str) -> bool:
        with self._lock:
            return gateway_id in self._subscriptions

    def publish(self, batches: dict[str, _Batch]) -> list[str]:
        """Sends each gateway its batch; returns the gateways nobody subscribes to."""
        unread = []
        with self._lock:
            for gateway_id, batch in batches.items():
                subscriptions = self._subscriptions.get(gateway_id)
                if not subscriptions:
                    unread.append(gateway_id)
                for subscription in subscriptions or ():
                    subscription.put(batch)
        return unread

    def close(self) -> None:
        """Ends every subscription after what was published; later subscribes fail."""
        with self._lock:
            self._closed = True
            subscriptions, self._subscriptions = self._subscriptions, defaultdict(list)
        for group in subscriptions.values():
            for subscription in group:
                subscription.close()
