"""The block pool's KV events: what the prefix-cache index gained and lost since the
last take, each hash's last change only, a reset as `cleared`; applied in the
documented order they rebuild exactly the index (KvMirror). Then what the publishers
that number them send: NATS, and the engine protocol's stream with tokens and parents."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

import msgspec
from smg_grpc_proto.generated import common_pb2 as smg

from scheduler_svc.block_pool import BlockPool, KvEventLog, KvEvents
from scheduler_svc.engine_protocol.kv_events import KvEventStream, block_hash_int64, to_batch
from scheduler_svc.kv_event_publisher import KvEventPublisher
from scheduler_svc.kv_mirror import KvMirror
from scheduler_svc.output_hub import OutputHub
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from services.block_hash import extend_block_hashes, extra_keys_bytes
from services.lora_request import LoRARequest
from services.messages import StepResult
from services.sampling_params import SamplingParams
from services.scheduler_messages import KvSnapshotResponse, NumberedKvEvents


def test_stores_evictions_and_resets_rebuild_the_index() -> None:
    pool = BlockPool(2)
    pool.events = KvEventLog()
    mirror = KvMirror()
    assert pool.events.take() is None  # nothing changed

    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    events = pool.events.take()
    assert events == KvEvents(False, [], [b"A", b"B"])
    mirror.apply(events)

    pool.free([a, b])  # evictable, still indexed: no event
    assert pool.events.take() is None
    [c] = pool.allocate(1)  # evicts the least recently freed: B (a request frees its tail first)
    pool.cache(c, b"C")
    events = pool.events.take()
    assert events == KvEvents(False, [b"B"], [b"C"])
    mirror.apply(events)
    assert set(mirror.snapshot().block_hashes) == {b"A", b"C"}

    [d] = pool.allocate(1)  # evicts A
    pool.cache(d, b"D")
    pool.reset_prefix_cache()
    pool.free([c, d])
    [e] = pool.allocate(1)
    pool.cache(e, b"E")
    events = pool.events.take()
    assert events == KvEvents(True, [], [b"E"])  # what came before the reset no longer matters
    mirror.apply(events)
    assert mirror.snapshot() == KvSnapshotResponse(seq=3, block_hashes=[b"E"])


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
        self.sent: list[NumberedKvEvents] = []

    def call_soon_threadsafe(self, create_task: Callable[[Coroutine[None, None, None]], None],
                             send: Coroutine[None, None, None]) -> None:
        create_task(send)

    def create_task(self, send: Coroutine[None, None, None]) -> None:
        asyncio.run(send)

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(msgspec.msgpack.decode(payload, type=NumberedKvEvents))


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
    assert stream.snapshot() == publisher.snapshot() == KvSnapshotResponse(seq=3, block_hashes=[b"E"])
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


def test_stored_blocks_carry_their_tokens_and_parent_on_the_engine_protocol() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                          block_size=4, num_blocks=16, vocab_size=1000))
    log = scheduler.block_pool.events = KvEventLog()
    sampled = 7

    def step() -> list[smg.KvBlocksStored]:
        plan = scheduler.schedule()
        scheduler.update(plan, StepResult(plan.step_id, {rid: [sampled] for rid in plan.num_scheduled_tokens}))
        events = log.take()
        return [] if events is None else [e.stored for e in to_batch(1, events).events if e.HasField("stored")]

    def add(request_id: str, prompt: list[int]) -> list[bytes]:
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=4), (2,), cache_salt="t"))
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt + [sampled] * 4, 4, extra_keys_bytes(cache_salt="t"))
        return [block_hash_int64(h) for h in hashes]

    prompt = list(range(10, 20))  # two full blocks and two tokens
    hashes = add("a", prompt)
    [stored] = step()  # the prompt's full blocks, one chain from the root
    assert not stored.HasField("parent_block_hash") and stored.cache_salt == "t"
    assert [(b.block_hash, list(b.token_ids), b.block_size) for b in stored.blocks] == [
        (hashes[0], prompt[0:4], 4), (hashes[1], prompt[4:8], 4)]
    assert step() == []  # 11 tokens computed: no new full block
    [stored] = step()  # the third block fills with two sampled tokens: the child of the second
    assert stored.parent_block_hash == hashes[1]
    assert [(b.block_hash, list(b.token_ids)) for b in stored.blocks] == [(hashes[2], prompt[8:10] + [sampled] * 2)]

    # Another prompt with the first block in common: its own blocks chain on from that one.
    other = prompt[:4] + list(range(50, 58))
    other_hashes = add("b", other)
    [stored] = step()
    assert stored.parent_block_hash == hashes[0]
    assert [(b.block_hash, list(b.token_ids)) for b in stored.blocks] == [
        (other_hashes[1], other[4:8]), (other_hashes[2], other[8:12])]


def test_an_adapter_s_blocks_hash_apart_and_carry_its_id_and_name_on_the_engine_protocol() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                          block_size=4, num_blocks=16, vocab_size=1000, max_loras=1))
    log = scheduler.block_pool.events = KvEventLog()
    prompt = list(range(10, 19))  # two full blocks and a token
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1), (2,),
                                  lora_request=LoRARequest("tuned", 7, "/adapters/tuned")))
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, {"a": [5]}))
    [stored] = [e.stored for e in to_batch(1, log.take()).events if e.HasField("stored")]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 4, extra_keys_bytes(lora_id=7))
    assert stored.lora_name == "tuned"
    assert [(b.block_hash, b.lora_id) for b in stored.blocks] == [(block_hash_int64(h), 7) for h in hashes]
