"""The block pool's KV events: what the prefix-cache index gained and lost since the
last take, each hash's last change only, a reset as `cleared`; applied in the
documented order they rebuild exactly the index."""
from __future__ import annotations

from scheduler_svc.block_pool import BlockPool, KvEventLog, KvEvents


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
