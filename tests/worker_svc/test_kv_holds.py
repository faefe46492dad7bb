"""A prefill replica's worker serving the blocks its scheduler holds for decode replicas
(worker_svc/runtime/kv_transfer.py): a fetch by position waits for the prefill to publish
each next block, and stops at once (the consumer recomputes the rest) when the hold ends
or the scheduler running that prefill is gone, rather than after the consumer's timeout.
Over NIXL (kv_nixl.py) the consumer reads the named blocks itself, and a hold ends only
once they are read."""
from __future__ import annotations

import threading
import time

import msgspec
import torch

from services.kv_transfer_messages import KvFetchRequest, NixlAgentInfo
from services.messages import StepPlan
from worker_svc.runtime.kv_nixl import NixlBlocks
from worker_svc.runtime.kv_peer import GrpcKvBlocks
from worker_svc.runtime.kv_transfer import KvTransfer

NUM_BLOCKS = 8


def producer(gone: threading.Event) -> tuple[KvTransfer, str]:
    caches = [torch.arange(2 * NUM_BLOCKS * 4 * 2 * 3, dtype=torch.float32).view(2, NUM_BLOCKS, 4, 2, 3)]
    peer = GrpcKvBlocks(caches, timeout_s=30.0)
    return KvTransfer(caches, [], [], peer, scheduler_gone=gone.is_set), peer.layout


def serve_all(transfer: KvTransfer, request: KvFetchRequest) -> tuple[list[int], BaseException | None, float]:
    """The indexes served, how the stream ended, and when (seconds after it began)."""
    served, started = [], time.monotonic()
    try:
        for block in transfer.serve(request):
            served.append(block.index)
    except ValueError as exc:
        return served, exc, time.monotonic() - started
    return served, None, time.monotonic() - started


def test_a_fetch_by_position_follows_the_published_blocks_and_ends_with_the_hold() -> None:
    gone = threading.Event()
    transfer, layout = producer(gone)
    transfer.apply(StepPlan(step_id=1, kv_holds={"r": [5, 2]}))
    result: list = []
    fetch = threading.Thread(target=lambda: result.append(serve_all(
        transfer, KvFetchRequest("r", [0, 1, 2, 3], layout, by_position=True))))
    fetch.start()
    time.sleep(0.3)
    transfer.apply(StepPlan(step_id=2, kv_holds={"r": [5, 2, 7]}))  # the next chunk published a block
    time.sleep(0.3)
    transfer.apply(StepPlan(step_id=3, kv_hold_ends=["r"]))  # preempted: its blocks are its own no more
    fetch.join(5)
    served, error, _ = result[0]
    assert served == [0, 1, 2] and "hold ended" in str(error)


def test_a_fetch_waiting_on_a_gone_scheduler_ends_at_once() -> None:
    gone = threading.Event()
    transfer, layout = producer(gone)
    transfer.apply(StepPlan(step_id=1, kv_holds={"r": [1]}))
    threading.Timer(0.3, gone.set).start()
    served, error, seconds = serve_all(transfer, KvFetchRequest("r", [0, 1, 2], layout, by_position=True))
    assert served == [0] and error is not None and seconds < 2.0


def test_a_gone_schedulers_holds_end_for_its_successor() -> None:
    """Blocks held for a dead scheduler's requests are its successor's to reuse: none is served."""
    transfer, layout = producer(threading.Event())
    transfer.apply(StepPlan(step_id=1, kv_holds={"r": [3, 4]}))
    transfer.end_holds()
    served, error, _ = serve_all(transfer, KvFetchRequest("r", [3, 4], layout))
    assert served == [] and "hold ended" in str(error)


def test_blocks_read_over_nixl_are_the_producers_and_a_hold_ends_once_they_are_read() -> None:
    """The consumer reads the blocks the stream names straight from the producer's cache
    into its own (two NIXL agents, UCX over this host): every block held when the fetch
    comes, named in one message and read in one READ. The producer's hold ends only
    once the reads are done (their notifications came), or at most _ABANDONED_SETTLE_S after
    the stream ended early (a consumer ends it early only once its READs ended; a dead one
    reads nothing), and a run named but never read while the stream stands holds it at
    most _SETTLE_S."""
    caches = [torch.randn(2, NUM_BLOCKS, 4, 2, 3) for _ in range(3)]
    nixl = NixlBlocks(caches)
    transfer = KvTransfer(caches, [], [], GrpcKvBlocks(caches, 30.0, nixl))
    transfer.apply(StepPlan(step_id=1, kv_holds={"r": [6, 1, 4], "s": [2]}))
    layout = GrpcKvBlocks(caches, 30.0).layout
    header, *named = transfer.serve(KvFetchRequest("r", [6, 1, 4], layout, nixl=True))
    assert header.index == -1 and [(b.index, b.payload, b.blocks) for b in named] == [(0, b"", [6, 1, 4])]
    producer = msgspec.msgpack.decode(header.payload, type=NixlAgentInfo)
    mine = [torch.zeros_like(cache) for cache in caches]
    consumer = NixlBlocks(mine)
    reads = consumer.reads(producer, timeout_s=5.0)
    reads.post(named[0].blocks, [0, 5, 3], "r:0")
    assert reads.finish() == 3 and reads.failed is None
    for cache, copy in zip(caches, mine):
        for source, target in ((6, 0), (1, 5), (4, 3)):
            assert torch.equal(copy[:, target], cache[:, source])
        assert not copy[:, [1, 2, 4, 6, 7]].any()  # nothing else written
    started = time.monotonic()
    transfer.apply(StepPlan(step_id=2, kv_hold_ends=["r"]))  # read: nothing to wait for
    assert time.monotonic() - started < 0.5
    _, unread = transfer.serve(KvFetchRequest("s", [2], layout, nixl=True))
    assert unread.blocks == [2]
    started = time.monotonic()
    transfer.apply(StepPlan(step_id=3, kv_hold_ends=["s"]))  # named, never read
    assert 1.5 < time.monotonic() - started < 5.0
    transfer.apply(StepPlan(step_id=4, kv_holds={"t": [2], "u": [3]}))  # nothing named: nothing to wait for
    started = time.monotonic()
    transfer.apply(StepPlan(step_id=5, kv_hold_ends=["t"]))
    assert time.monotonic() - started < 0.5
    transfer.apply(StepPlan(step_id=6, kv_holds={"v": [4]}))
    early = transfer.serve(KvFetchRequest("u", [3], layout, nixl=True))
    next(early), next(early)  # named, never read: then the consumer ends the stream (it stopped, or died)
    transfer.abandon("u")  # what the worker's server does when a stream ends before the worker ends it
    later = transfer.serve(KvFetchRequest("v", [4], layout, nixl=True))
    next(later)
    transfer.abandon("v")  # ended while the worker had yet to name its block: named into a dead stream
    next(later)
    started = time.monotonic()
    transfer.apply(StepPlan(step_id=7, kv_hold_ends=["u", "v"]))  # u's run unread: a short wait, not _SETTLE_S
    assert time.monotonic() - started < 0.5


def test_a_fetch_by_position_over_nixl_names_each_published_run_once() -> None:
    """Blocks published together (a prefill chunk's) are named in one message, those
    published later in the next."""
    caches = [torch.randn(2, NUM_BLOCKS, 4, 2, 3)]
    transfer = KvTransfer(caches, [], [], GrpcKvBlocks(caches, 30.0, NixlBlocks(caches)))
    layout = GrpcKvBlocks(caches, 30.0).layout
    transfer.apply(StepPlan(step_id=1, kv_holds={"r": [5, 2]}))
    messages: list = []
    fetch = threading.Thread(target=lambda: messages.extend(
        transfer.serve(KvFetchRequest("r", [0, 1, 2, 3], layout, by_position=True, nixl=True))))
    fetch.start()
    time.sleep(0.3)
    transfer.apply(StepPlan(step_id=2, kv_holds={"r": [5, 2, 7, 3]}))  # the next chunk published two blocks
    fetch.join(5)
    assert [(m.index, m.blocks) for m in messages[1:]] == [(0, [5, 2]), (2, [7, 3])]
