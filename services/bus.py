"""Token streaming over NATS: schedulers publish, each gateway subscribes to its own subject.

Subject `kvfleet.out.<gateway_id>` carries scheduler.proto's StepOutputs, the message
StreamOutputs sends over gRPC: one message per engine step per gateway with every new
delta of that gateway's requests, never one per token. Core NATS is at-most-once, so
whatever may have lost tokens ends its requests with an explicit error instead:
a gateway's NATS disconnect fails its open streams, and a delta too large for NATS
becomes an ABORT carrying the reason.

Both ends keep their NATS client on an asyncio loop in a daemon thread: the publisher
is called from the scheduler's step-loop thread, which must never wait on the network,
and the subscriber (services/bus_subscriber.py) serves consumers on any event loop.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import nats
from nats.aio.client import Client

from services.pb.kvfleet.v1 import common_pb2, scheduler_pb2
from services.transport.output_hub import OutputHub

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Batches = Mapping[str, Sequence[common_pb2.TokenDelta]]
# A repeated message field costs its tag and a length varint on top of the element.
_FIELD_OVERHEAD = 6


def subject(gateway_id: str) -> str:
    return f"kvfleet.out.{gateway_id}"


class NatsThread:
    """One NATS connection, owned by an event loop running on its own daemon thread."""

    def __init__(self, url: str, name: str, connect_timeout_s: float, **callbacks: Callable[[], Awaitable[None]]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        # Reconnect forever: a NATS restart must not end a long-lived role.
        connect = nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, **callbacks)
        try:
            self.nc: Client = self.run(connect, connect_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Awaitable[T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self.run(self.nc.close(), timeout_s)
        except Exception:
            logger.exception("could not close the NATS connection cleanly")
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _payloads(deltas: Sequence[common_pb2.TokenDelta], max_bytes: int) -> Iterator[bytes]:
    """StepOutputs messages of at most max_bytes each: normally one."""
    message, size = scheduler_pb2.StepOutputs(), 0
    for delta in deltas:
        cost = delta.ByteSize() + _FIELD_OVERHEAD
        if cost > max_bytes:  # cannot travel at all: end the request, saying why
            delta = common_pb2.TokenDelta(
                request_id=delta.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT,
                error=f"a step's output of {cost} bytes exceeds the NATS max_payload of {max_bytes}",
            )
            cost = delta.ByteSize() + _FIELD_OVERHEAD
        if size + cost > max_bytes:
            yield message.SerializeToString()
            message, size = scheduler_pb2.StepOutputs(), 0
        message.deltas.append(delta)
        size += cost
    if message.deltas:
        yield message.SerializeToString()


class OutputPublisher:
    """The scheduler's end. publish() is thread-safe and never blocks: it hands the
    step's batches to the NATS thread, which sends one message per gateway."""

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        self._nats = NatsThread(url, "kvfleet-nats-publisher", connect_timeout_s)
        self._last_loss = -math.inf  # monotonic time of the last batch that could not be sent
        self._queue: asyncio.Queue[_Batches | None] = self._nats.run(self._make_queue(), connect_timeout_s)
        self._sender = asyncio.run_coroutine_threadsafe(self._send_forever(), self._nats.loop)

    @property
    def connected(self) -> bool:
        return self._nats.connected

    def lost_within(self, seconds: float) -> bool:
        """Whether some deltas could not be sent in the last `seconds`: their gateways
        wait for tokens that will never come, so the scheduler withholds its lease
        until they have seen it lapse and failed its requests."""
        return time.monotonic() - self._last_loss < seconds

    def publish(self, batches: _Batches) -> None:
        """Takes ownership of `batches` (the caller must not change them afterwards)."""
        self._nats.loop.call_soon_threadsafe(self._queue.put_nowait, batches)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what was published, then disconnects."""
        self._nats.loop.call_soon_threadsafe(self._queue.put_nowait, None)
        try:
            self._sender.result(timeout_s)
        except Exception:
            logger.exception("could not send the last token batches")
        self._nats.close(timeout_s)

    async def _make_queue(self) -> asyncio.Queue[_Batches | None]:
        return asyncio.Queue()

    async def _send_forever(self) -> None:
        closing = False
        while not closing:
            # Steps that queued up while we were sending go out merged: a slow link gets
            # fewer, larger messages, still in step order per gateway.
            pending = [await self._queue.get()]
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            merged: defaultdict[str, list[common_pb2.TokenDelta]] = defaultdict(list)
            for batches in pending:
                if batches is None:
                    closing = True
                    break
                for gateway_id, deltas in batches.items():
                    merged[gateway_id].extend(deltas)
            for gateway_id, deltas in merged.items():
                await self._send(gateway_id, deltas)
        await self._nats.nc.flush()

    async def _send(self, gateway_id: str, deltas: list[common_pb2.TokenDelta]) -> None:
        try:
            for payload in _payloads(deltas, self._nats.nc.max_payload):
                await self._nats.nc.publish(subject(gateway_id), payload)
        except Exception:  # e.g. NATS has been away long enough to fill the reconnect buffer
            self._last_loss = time.monotonic()
            logger.exception("could not publish %d deltas to gateway %s", len(deltas), gateway_id)


class NatsOutputHub(OutputHub):
    """The scheduler's OutputHub in cluster mode: every batch goes out on NATS too.

    NATS cannot tell the scheduler who listens, so every gateway counts as subscribed:
    a gateway subscribes to its subject before it submits anything.
    """

    def __init__(self, url: str, connect_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.publisher = OutputPublisher(url, connect_timeout_s)

    def has_subscriber(self, gateway_id: str) -> bool:
        return True

    def publish(self, batches: dict[str, list[common_pb2.TokenDelta]]) -> list[str]:
        super().publish(batches)  # gRPC StreamOutputs readers, if there are any
        self.publisher.publish(batches)
        return []

    def close(self) -> None:
        super().close()
        self.publisher.close()
