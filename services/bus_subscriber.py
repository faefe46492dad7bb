"""A gateway's end of the token stream: one NATS subscription to `kvfleet.out.<gateway_id>`,
demultiplexed into per-request asyncio queues.

Each queue is fed on the event loop that opened it, with one `call_soon_threadsafe`
per loop per NATS message (never one per token), like AsyncEngine. A request with n
or best_of > 1 runs as child requests whose deltas keep their child ids; they all
go to the parent's queue, which gets its end once every child has ended.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

from services.bus import NatsThread, subject
from services.engine_client import EngineUnavailable, RequestFailed
from services.messages import TokenDelta
from services.parallel_sampling import engine_request_ids
from services.pb.kvfleet.v1 import scheduler_pb2
from services.request_routes import RequestRoutes, Route
from services.transport.convert import delta_from_proto

logger = logging.getLogger(__name__)

# What a request's queue carries: deltas, or the exception that ends the request.
Item = TokenDelta | BaseException


@dataclass(eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)


class OutputSubscriber:
    def __init__(self, url: str, gateway_id: str, connect_timeout_s: float = 10.0) -> None:
        self.gateway_id = gateway_id
        # Guards the tables below, which the NATS thread and the consumers' loops share.
        self._lock = threading.Lock()
        self._routes: RequestRoutes[_Stream] = RequestRoutes()
        self._closing = False
        self._nats = NatsThread(url, "kvfleet-nats-subscriber", connect_timeout_s,
                                disconnected_cb=self._on_disconnect, error_cb=self._on_error)
        self._nats.run(self._subscribe(), connect_timeout_s)

    @property
    def connected(self) -> bool:
        return self._nats.connected

    def open(self, request_id: str, num_children: int = 1) -> asyncio.Queue[Item]:
        """Call on the consumer's loop, before the request is submitted, so no delta is
        missed. `num_children`: with n or best_of > 1, its deltas carry child ids."""
        stream = _Stream(request_id, asyncio.get_running_loop())
        with self._lock:
            # Under the lock: a disconnect after this check fails the stream (_on_disconnect).
            if not self.connected:
                raise EngineUnavailable("the token stream (NATS) is disconnected")
            ids = engine_request_ids(request_id, num_children)
            if self._routes.get(request_id) is not None or any(self._routes.of(i) is not None for i in ids):
                raise ValueError(f"request {request_id!r} is already streaming")
            self._routes.add(request_id, num_children, stream)
        return stream.queue

    def discard(self, request_id: str) -> None:
        """Stops routing the request's deltas (it ended, or its consumer left)."""
        with self._lock:
            route = self._routes.get(request_id)
            if route is not None:
                self._drop(route)

    def fail(self, request_ids: Sequence[str] | None, error: Callable[[str], BaseException]) -> None:
        """Ends these open streams (None: all of them) with error(request_id); any thread."""
        with self._lock:
            routes = list(self._routes) if request_ids is None else [self._routes.get(r) for r in request_ids]
            streams = [self._drop(route) for route in routes if route is not None]
        _post({stream: [error(stream.request_id)] for stream in streams})

    def close(self) -> None:
        self._closing = True
        self._nats.close()

    def _drop(self, route: Route[_Stream]) -> _Stream:
        self._routes.remove(route)
        return route.target

    async def _subscribe(self) -> None:
        await self._nats.nc.subscribe(subject(self.gateway_id), cb=self._on_message)
        await self._nats.nc.flush()  # the server knows the subscription: submits may start

    async def _on_message(self, msg: Msg) -> None:
        outputs = scheduler_pb2.StepOutputs.FromString(msg.data)
        items: defaultdict[_Stream, list[Item]] = defaultdict(list)
        with self._lock:
            for message in outputs.deltas:
                route = self._routes.of(message.request_id)
                if route is None:  # ended here already (e.g. its client left): drop
                    continue
                stream, delta = route.target, delta_from_proto(message)
                if message.error:  # one engine request failed: the whole request does
                    if delta.new_token_ids:
                        items[stream].append(TokenDelta(delta.request_id, delta.new_token_ids, logprobs=delta.logprobs))
                    items[stream].append(RequestFailed(stream.request_id, message.error))
                    self._drop(route)
                    continue
                items[stream].append(delta)
                if delta.finish_reason is not None:
                    self._routes.end(message.request_id)
        _post(items)

    async def _on_disconnect(self) -> None:
        if not self._closing:  # messages published while we are away are gone for good (core NATS)
            self._fail_all("the token stream (NATS) was disconnected")

    async def _on_error(self, error: Exception) -> None:
        if isinstance(error, SlowConsumerError):  # the client dropped a message: whose tokens, it cannot say
            self._fail_all("the gateway fell behind its token stream (NATS slow consumer)")
        else:
            logger.warning("NATS: %r", error)

    def _fail_all(self, reason: str) -> None:
        logger.warning("gateway %s: %s; failing its open requests", self.gateway_id, reason)
        self.fail(None, lambda request_id: RequestFailed(request_id, reason))


def _deliver(items: list[tuple[asyncio.Queue[Item], Item]]) -> None:
    """Runs on the consumer's event loop."""
    for target, item in items:
        target.put_nowait(item)


def _post(items: Mapping[_Stream, list[Item]]) -> None:
    by_loop: defaultdict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = defaultdict(list)
    for stream, stream_items in items.items():
        by_loop[stream.loop].extend((stream.queue, item) for item in stream_items)
    for loop, loop_items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, loop_items)
        except RuntimeError:  # that loop is closed: nobody reads these streams any more
            pass
