"""Worker to worker KV for prefill/decode disaggregation (docs/disaggregation.md): the
transport behind the KV connector's remote loads.

A producer's worker serves `FetchKvBlocks`: the blocks its scheduler holds for a
consumer, one gRPC message per block ([layer][k|v][token][head][dim], the same bytes
the file tiers store), in the order asked. A consumer's worker, told by a KvLoad whose
`remote` is set, fetches them on a loader thread and copies each into its own device
block as it arrives, so the copy overlaps the network. Which blocks and where they go
is the schedulers' business; this moves bytes and says how many arrived whole.

`KvBlockSource` is the seam for another transport (NIXL on GPU clusters, reading the
producer's registered KV memory over RDMA or NVLink instead of a gRPC stream): the
connector calls only `fetch` and `serve`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import grpc
import torch

from services.kv_transfer_messages import KvBlock, KvFetchRequest, RemoteBlocks
from services.transport.channel import open_channel
from services.transport.role_services import WORKER
from services.transport.rpc import Stub

logger = logging.getLogger(__name__)


class KvBlockSource(Protocol):
    def fetch(self, remote: RemoteBlocks, block_ids: list[int], land: Callable[[int, torch.Tensor], None]) -> int:
        """Fetches the producer's `block_ids` in order, handing each to `land(index, block)`
        as it arrives; returns how many leading blocks arrived whole."""

    def serve(self, request: KvFetchRequest, held: Callable[[int], AbstractContextManager[int]]
              ) -> Iterator[KvBlock]:
        """The blocks a consumer asked of this worker, in its order; each read inside
        `held(entry)`, which gives the block to read (`entry` is one, or its place in the
        prompt) and raises (ValueError) unless it is held for the request: a block that is
        not may be rewritten meanwhile."""


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
    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float) -> None:
        self.kv_caches = kv_caches
        cache = kv_caches[0]
        self._block_shape = (len(kv_caches), 2, *cache.shape[2:])  # [layer][k|v][token][head][dim]
        self.layout = f"{str(cache.dtype).removeprefix('torch.')}:{'x'.join(map(str, self._block_shape))}"
        self._timeout_s = timeout_s
        self._stubs: dict[str, Stub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def serve(self, request: KvFetchRequest, held: Callable[[int], AbstractContextManager[int]]
              ) -> Iterator[KvBlock]:
        if request.layout != self.layout:
            raise ValueError(f"the consumer's KV layout {request.layout} is not this worker's {self.layout}")
        for index, entry in enumerate(request.block_ids):
            with held(entry) as block:  # a copy (stack), taken while nothing can write the block
                stacked = torch.stack([cache[:, block] for cache in self.kv_caches]).cpu()
            yield KvBlock(index, stacked.contiguous().view(torch.uint8).numpy().tobytes())

    def fetch(self, remote: RemoteBlocks, block_ids: list[int], land: Callable[[int, torch.Tensor], None]) -> int:
        """The timeout bounds the whole fetch of held blocks; a streamed fetch (by position,
        beside the producer's prefill) lasts as long as that prefill, so there it bounds the
        wait for each next block instead."""
        count = 0
        blocks = self._stub(remote.address).FetchKvBlocks(
            KvFetchRequest(remote.request_id, block_ids, self.layout, remote.by_position),
            timeout=None if remote.by_position else self._timeout_s)
        watchdog: threading.Timer | None = None

        def arm() -> None:
            nonlocal watchdog
            if watchdog is not None:
                watchdog.cancel()
            watchdog = threading.Timer(self._timeout_s, blocks.cancel)
            watchdog.daemon = True
            watchdog.start()

        try:
            for block in _armed(blocks, arm if remote.by_position else None):
                if block.index != count:
                    raise ValueError(f"block {block.index} came where block {count} was due")
                payload = torch.frombuffer(bytearray(block.payload), dtype=torch.uint8)
                land(count, payload.view(self.kv_caches[0].dtype).view(self._block_shape))
                count += 1
        except (grpc.RpcError, ValueError) as exc:  # whatever arrived whole counts; the rest is recomputed
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            logger.warning("KV fetch of %s from %s stopped after %d of %d blocks: %s", remote.request_id,
                           remote.address, count, len(block_ids), details)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        return count

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
