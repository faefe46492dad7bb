"""The scheduler's end of the token stream: each step's deltas, per gateway, on NATS
(`kvfleet.out.<gateway_id>`, see services/nats_link.py). Core NATS is at-most-once, so
every message is numbered and kept a while (scheduler_svc/replay_window.py): a gateway
that missed some asks for them again, and after a NATS outage of our own we announce
the last number we sent each gateway. A delta too large for NATS becomes an ABORT
carrying the reason.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence

from scheduler_svc.gateway_watch import GatewayWatch
from scheduler_svc.kv_event_publisher import KvEventPublisher
from scheduler_svc.output_hub import OutputHub
from scheduler_svc.replay_window import ReplayWindow
from services.messages import TokenDelta
from services.nats_link import NatsThread, subject
from services.scheduler_messages import StepOutputs
from services.transport.rpc import encode

logger = logging.getLogger(__name__)

_Batches = Mapping[str, Sequence[TokenDelta]]
# What the replay window's stamp adds (the instance id, the sequence number) and the
# array's header: an upper bound.
_STAMP_BYTES = 64


def _messages(deltas: list[TokenDelta], max_bytes: int) -> Iterator[StepOutputs]:
    """StepOutputs messages of at most max_bytes each once stamped: normally one, whose
    size is measured as a whole; only a larger batch is measured delta by delta."""
    max_bytes -= _STAMP_BYTES
    if len(encode(deltas)) <= max_bytes:
        yield StepOutputs(deltas)
        return
    message, size = StepOutputs(), 0
    for delta in deltas:
        cost = len(encode(delta))
        if cost > max_bytes:  # cannot travel at all: end the request, saying why
            delta = TokenDelta(delta.request_id, [], "abort",
                               error=f"a step's output of {cost} bytes exceeds the NATS max_payload of {max_bytes}")
            cost = len(encode(delta))
        if size + cost > max_bytes:
            yield message
            message, size = StepOutputs(), 0
        message.deltas.append(delta)
        size += cost
    if message.deltas:
        yield message


class OutputPublisher:
    """The scheduler's end. publish() is thread-safe and never blocks: it hands the
    step's batches to the NATS thread, which sends one message per gateway."""

    def __init__(self, url: str, instance_id: str, connect_timeout_s: float = 10.0) -> None:
        self.window = ReplayWindow(instance_id)
        self.nats = NatsThread(url, "kvfleet-nats-publisher", connect_timeout_s, reconnected_cb=self._announce)
        self._queue: asyncio.Queue[_Batches | None] = self.nats.run(self._make_queue(), connect_timeout_s)
        self._sender = asyncio.run_coroutine_threadsafe(self._send_forever(), self.nats.loop)

    def publish(self, batches: _Batches) -> None:
        """Takes ownership of `batches` (the caller must not change them afterwards)."""
        self.nats.loop.call_soon_threadsafe(self._queue.put_nowait, batches)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what was published, then disconnects."""
        self.nats.loop.call_soon_threadsafe(self._queue.put_nowait, None)
        try:
            self._sender.result(timeout_s)
        except Exception:
            logger.exception("could not send the last token batches")
        self.nats.close(timeout_s)

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
            merged: defaultdict[str, list[TokenDelta]] = defaultdict(list)
            for batches in pending:
                if batches is None:
                    closing = True
                    break
                for gateway_id, deltas in batches.items():
                    merged[gateway_id].extend(deltas)
            for gateway_id, deltas in merged.items():
                await self._send(gateway_id, deltas)
        await self.nats.nc.flush()

    async def _send(self, gateway_id: str, deltas: list[TokenDelta]) -> None:
        for message in _messages(deltas, self.nats.nc.max_payload):
            payload = self.window.record(gateway_id, message)  # kept, even if it cannot go now
            try:
                await self.nats.nc.publish(subject(gateway_id), payload)
            except Exception as exc:  # NATS has been away long enough to fill the client's buffer
                logger.warning("gateway %s's message %d waits for a replay: %r", gateway_id, message.seq, exc)

    async def _announce(self) -> None:
        """Back on NATS: tells each gateway the last message we sent it. What we sent
        while away may be lost, and a gateway missing our last messages would never hear of it."""
        for gateway_id, payload in self.window.announcements().items():
            await self.nats.nc.publish(subject(gateway_id), payload)


class NatsOutputHub(OutputHub):
    """The scheduler's OutputHub in cluster mode: every batch goes out on NATS too.

    NATS cannot tell the scheduler who listens, so every gateway counts as subscribed
    (a gateway subscribes to its subject before it submits anything) until `gateways`,
    when given, says it is gone: then its requests are aborted.
    """

    def __init__(self, url: str, instance_id: str, connect_timeout_s: float = 10.0,
                 gateways: GatewayWatch | None = None) -> None:
        super().__init__()
        self._gateways = gateways
        self.publisher = OutputPublisher(url, instance_id, connect_timeout_s)
        self.replay_window = self.publisher.window
        self.kv_events = KvEventPublisher(self.publisher.nats, instance_id)

    def has_subscriber(self, gateway_id: str) -> bool:
        return True

    def publish(self, batches: dict[str, list[TokenDelta]]) -> list[str]:
        super().publish(batches)  # gRPC StreamOutputs readers, if there are any
        self.publisher.publish(batches)
        return [gateway_id for gateway_id in batches if self._gateways is not None and self._gateways.gone(gateway_id)]

    def close(self) -> None:
        super().close()
        self.publisher.close()
        if self._gateways is not None:
            self._gateways.close()
