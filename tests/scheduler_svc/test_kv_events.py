"""The block pool's KV events: what the prefix-cache index gained and lost since the
last take, each hash's last change only, a reset as `cleared`; applied in the
documented order they rebuild exactly the index. The publishers that number them."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

from scheduler_svc.block_pool import BlockPool, KvEventLog, KvEvents
from scheduler_svc.kv_event_publisher import KvEventPublisher
from scheduler_svc.output_hub import OutputHub
from scheduler_svc.vllm_kv_events import KvEventStream
from services.pb.kvfleet.v1 import scheduler_pb2


def apply(index: set[bytes], events: KvEvents) -> None:
    if events.cleared:
        index.clear()
    index.difference_update(events.removed)
    index.update(events.stored)


def test_stores_evictions_and_resets_rebuild_the_index() -> None:
    pool = BlockPool(2)
    pool.events = KvEventLog()
    mirror: set[bytes] = set()
    assert pool.events.take() is None  # nothing changed

    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    events = pool.events.take()
    assert events == KvEvents(False, [], [b"A", b"B"])
    apply(mirror, events)

    pool.free([a, b])  # evictable, still indexed: no event
    assert pool.events.take() is None
    [c] = pool.allocate(1)  # evicts the least recently freed: B (a request frees its tail first)
    pool.cache(c, b"C")
    events = pool.events.take()
    assert events == KvEvents(False, [b"B"], [b"C"])
    apply(mirror, events)
    assert mirror == {b"A", b"C"}

    [d] = pool.allocate(1)  # evicts A
    pool.cache(d, b"D")
    pool.reset_prefix_cache()
    pool.free([c, d])
    [e] = pool.allocate(1)
    pool.cache(e, b"E")
    events = pool.events.take()
    assert events == KvEvents(True, [], [b"E"])  # what came before the reset no longer matters
    apply(mirror, events)
    assert mirror == {b"E"}


def test_a_hash_stored_and_evicted_within_one_take_is_one_removal() -> None:
    pool = BlockPool(1)
    pool.events = KvEventLog()
    [a] = pool.allocate(1)
    pool.cache(a, b"A")
    pool.free([a])
    pool.allocate(1)  # evicts A again
    assert pool.events.take() == KvEvents(False, [b"A"], [])


class FakeNats:
    """NatsThread's surface KvEventPublisher uses: each payload is sent at once."""

    def __init__(self) -> None:
        self.loop = self.nc = self
        self.sent: list[scheduler_pb2.KvEvents] = []

    def call_soon_threadsafe(self, create_task: Callable[[Coroutine[None, None, None]], None],
                             send: Coroutine[None, None, None]) -> None:
        create_task(send)

    def create_task(self, send: Coroutine[None, None, None]) -> None:
        asyncio.run(send)

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(scheduler_pb2.KvEvents.FromString(payload))


STEPS = [KvEvents(False, [], [b"A", b"B"]), KvEvents(False, [b"B"], [b"C"]), KvEvents(True, [], [b"E"])]


def test_the_engine_stream_numbers_and_mirrors_through_the_nats_publisher_it_wraps() -> None:
    nats = FakeNats()
    publisher = KvEventPublisher(nats, "s1")  # type: ignore[arg-type]
    stream = KvEventStream(publisher)
    hub = OutputHub()
    hub.kv_events = stream
    assert [hub.kv_events.publish(events) for events in STEPS] == [1, 2, 3]  # the mirror applies each once

    assert [(m.seq, m.cleared, list(m.removed), list(m.stored)) for m in nats.sent] == [
        (1, False, [], [b"A", b"B"]), (2, False, [b"B"], [b"C"]), (3, True, [], [b"E"])]
    assert stream.snapshot() == publisher.snapshot() == scheduler_pb2.KvSnapshotResponse(seq=3, block_hashes=[b"E"])
    resumed = stream.subscribe(2)
    assert resumed is not None
    assert [resumed.get_nowait().sequence_number for _ in range(2)] == [2, 3]


def test_the_engine_stream_alone_keeps_its_own_mirror() -> None:
    stream = KvEventStream(None, max_batches=2)
    for events in STEPS:
        stream.publish(events)
    snapshot = stream.snapshot()
    assert snapshot.seq == 3 and set(snapshot.block_hashes) == {b"E"}
    assert stream.subscribe(1) is None  # batch 1 is no longer held
    assert stream.subscribe(2) is not None
