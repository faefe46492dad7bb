"""Worker to worker KV for prefill/decode disaggregation (docs/disaggregation.md): the
transport behind the KV connector's remote loads.

A producer's worker serves `FetchKvBlocks`: the blocks its scheduler holds for a
consumer, in the order asked, as it holds them: a gRPC message per block with its bytes
([layer][k|v][token][head][dim], the same bytes the file tiers store), or, when the
consumer reads over NIXL (kv_nixl.py: vLLM's NixlConnector named in its config), a
message per run of blocks held together (a prefill chunk's, or all of a finished
prefill's) naming the producer's blocks that hold them, the first message saying where
the producer's KV memory is. A consumer's worker, told by a KvLoad whose `remote` is set,
fetches them on a loader thread and lands each message's blocks as it arrives (copies the
bytes in, or reads the run over NIXL in one READ), so landing overlaps the stream. Which blocks and where they
go is the schedulers' business; this moves bytes and says how many arrived whole.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import grpc
import msgspec
import torch

from services.kv_transfer_messages import KvBlock, KvFetchRequest, NixlAgentInfo, RemoteBlocks
from services.transport.channel import open_channel
from services.transport.role_services import WORKER
from services.transport.rpc import Stub
from worker_svc.runtime.kv_nixl import NixlBlocks, NixlReads

logger = logging.getLogger(__name__)


class KvBlockSource(Protocol):
    def fetch(self, remote: RemoteBlocks, sources: list[int], targets: list[int]) -> int:
        """Fetches the producer's `sources` in order into this worker's blocks `targets`,
        each as it arrives; returns how many leading blocks arrived whole."""

    def serve(self, request: KvFetchRequest, held: Callable[[int, int], AbstractContextManager[list[int]]]
              ) -> Iterator[KvBlock]:
        """The blocks a consumer asked of this worker, in its order; each read (or lent)
        inside `held(first, most)`, which gives the blocks that hold the request's entries
        from `first` on (waiting for the first, then at most `most` held already) and raises
        (ValueError) unless the first is held for the request: a block that is not may be
        rewritten meanwhile."""

    def settle(self, request_ids: Iterable[str]) -> None:
        """Their holds ended: returns once no consumer still reads their blocks."""

    def abandon(self, request_id: str) -> None:
        """The consumer ended the request's fetch stream before the producer did: it stopped
        (once every READ it posted had ended), or it died. It reads nothing more."""


def _armed(blocks: Iterator[KvBlock], arm: Callable[[], None] | None) -> Iterator[KvBlock]:
    """`blocks`, with `arm` called before waiting for each (a watchdog restarted)."""
    while True:
        if arm is not None:
            arm()
        block = next(blocks, None)
        if block is None:
            return
        yield block


class GrpcKvBlocks:
    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float, nixl: NixlBlocks | None = None) -> None:
        """`nixl`: this worker's NIXL agent, where NIXL is installed: it serves consumers
        that read over NIXL, and reads when its scheduler's plan says so (RemoteBlocks.nixl)."""
        self.kv_caches = kv_caches
        cache = kv_caches[0]
        self._block_shape = (len(kv_caches), 2, *cache.shape[2:])  # [layer][k|v][token][head][dim]
        self.layout = f"{str(cache.dtype).removeprefix('torch.')}:{'x'.join(map(str, self._block_shape))}"
        self._timeout_s = timeout_s
        self._nixl = nixl
        self._stubs: dict[str, Stub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def serve(self, request: KvFetchRequest, held: Callable[[int, int], AbstractContextManager[list[int]]]
              ) -> Iterator[KvBlock]:
        if request.layout != self.layout:
            raise ValueError(f"the consumer's KV layout {request.layout} is not this worker's {self.layout}")
        if request.nixl:
            if self._nixl is None:
                raise ValueError("this worker has no NIXL (pip install nixl) to serve a read over it")
            yield KvBlock(-1, self._nixl.info())
        index = 0
        while index < len(request.block_ids):
            # Over NIXL every block held now, named in one message for one READ; else one block's bytes.
            with held(index, len(request.block_ids) - index if request.nixl else 1) as blocks:
                if request.nixl:  # named, not copied: lent until the consumer has read them
                    self._nixl.lend(request.request_id, index)
                    message = KvBlock(index, b"", blocks)
                else:  # a copy (stack), taken while nothing can write the block
                    stacked = torch.stack([cache[:, blocks[0]] for cache in self.kv_caches]).cpu()
                    message = KvBlock(index, stacked.contiguous().view(torch.uint8).numpy().tobytes())
            yield message
            index += len(blocks)

    def settle(self, request_ids: Iterable[str]) -> None:
        if self._nixl is not None:
            self._nixl.settle(request_ids)

    def abandon(self, request_id: str) -> None:
        if self._nixl is not None:
            self._nixl.abandon(request_id)

    def fetch(self, remote: RemoteBlocks, sources: list[int], targets: list[int]) -> int:
        """The timeout bounds the whole fetch of held blocks; a streamed fetch (by position,
        beside the producer's prefill) lasts as long as that prefill, so there it bounds the
        wait for each next block instead."""
        count = 0
        over_nixl = remote.nixl and self._nixl is not None  # else the bytes in the stream: NIXL is not installed here
        # No gRPC deadline: a live consumer ends the stream early only once every READ it
        # posted has ended (end_early, and the end below), since the producer then takes
        # back what it lent (kv_nixl.py). `ending` keeps a READ from being posted meanwhile.
        blocks = self._stub(remote.address).FetchKvBlocks(
            KvFetchRequest(remote.request_id, sources, self.layout, remote.by_position, over_nixl))
        watchdog: threading.Timer | None = None
        reads: NixlReads | None = None  # over NIXL, once the producer said where its blocks are
        ending = threading.Lock()
        expired = False

        def end_early() -> None:
            nonlocal expired
            with ending:
                expired = True
                if reads is not None:
                    reads.finish()
                blocks.cancel()

        def arm() -> None:
            nonlocal watchdog
            if watchdog is not None:
                watchdog.cancel()
            watchdog = threading.Timer(self._timeout_s, end_early)
            watchdog.daemon = True
            watchdog.start()

        if not remote.by_position:
            arm()  # once, for the whole fetch
        try:
            for block in _armed(blocks, arm if remote.by_position else None):
                if block.index < 0 and over_nixl:
                    reads = self._nixl.reads(msgspec.msgpack.decode(block.payload, type=NixlAgentInfo),
                                             self._timeout_s)
                    continue
                if block.index != count:
                    raise ValueError(f"block {block.index} came where block {count} was due")
                if reads is not None:
                    if not block.blocks or count + len(block.blocks) > len(targets):
                        raise ValueError(f"a run of {len(block.blocks)} blocks named at block {count} of "
                                         f"{len(targets)}")
                    with ending:
                        if expired:
                            raise ValueError(f"its watchdog ended the fetch after {self._timeout_s:.0f} s")
                        reads.post(block.blocks, targets[count:count + len(block.blocks)],
                                   f"{remote.request_id}:{count}")
                    if reads.failed:
                        raise ValueError(reads.failed)
                    count += len(block.blocks)
                else:
                    self._land(block.payload, targets[count])
                    count += 1
        except (grpc.RpcError, ValueError) as exc:  # whatever arrived whole counts; the rest is recomputed
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            logger.warning("KV fetch of %s from %s stopped after %d of %d blocks: %s", remote.request_id,
                           remote.address, count, len(sources), details)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        with ending:
            # Over NIXL the blocks named are whole once their READs are: none may land after this returns.
            whole = reads.finish() if reads is not None else count
            blocks.cancel()  # a no-op on a stream that ended; else only now that no READ runs
        return whole

    def _land(self, payload: bytes, target: int) -> None:
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv_caches[0].dtype)
        block = block.view(self._block_shape).to(self.kv_caches[0].device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, target] = block[layer]

    def _stub(self, address: str) -> Stub:
        with self._lock:
            if address not in self._stubs:
                channel = open_channel(address)
                self._channels.append(channel)
                self._stubs[address] = WORKER.stub(channel)
            return self._stubs[address]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
