"""A gateway's end of the token stream: one NATS subscription to `kvfleet.out.<gateway_id>`,
demultiplexed into per-request RequestStreams (services/request_stream.py), fed with
one `call_soon_threadsafe` per loop per NATS message (never one per token).
Core NATS is at-most-once: a disconnect, or a message the client had to drop, fails
every open stream explicitly, since whose tokens were lost cannot be told.
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

from services.engine_client import EngineUnavailable, RequestFailed, RequestLost
from services.messages import TokenDelta
from services.nats_link import NatsThread, subject
from services.parallel_sampling import engine_request_ids
from services.pb.kvfleet.v1 import scheduler_pb2
from services.request_routes import RequestRoutes, Route
from services.request_stream import Item, RequestStream, post
from services.transport.convert import delta_from_proto

logger = logging.getLogger(__name__)

class OutputSubscriber:
    def __init__(self, url: str, gateway_id: str, connect_timeout_s: float = 10.0) -> None:
        self.gateway_id = gateway_id
        # Guards the tables below, which the NATS thread and the consumers' loops share.
        self._lock = threading.Lock()
        self._routes: RequestRoutes[RequestStream] = RequestRoutes()
        self._closing = False
        self._nats = NatsThread(url, "kvfleet-nats-subscriber", connect_timeout_s,
                                disconnected_cb=self._on_disconnect, error_cb=self._on_error)
        self._nats.run(self._subscribe(), connect_timeout_s)

    @property
    def connected(self) -> bool:
        return self._nats.connected

    def open(self, request_id: str, num_children: int = 1) -> RequestStream:
        """Call on the consumer's loop, before the request is submitted, so no delta is
        missed. `num_children`: with n or best_of > 1, its deltas carry child ids."""
        stream = RequestStream(request_id, num_children)
        with self._lock:
            # Under the lock: a disconnect after this check fails the stream (_on_disconnect).
            if not self.connected:
                raise EngineUnavailable("the token stream (NATS) is disconnected")
            ids = engine_request_ids(request_id, num_children)
            if self._routes.get(request_id) is not None or any(self._routes.of(i) is not None for i in ids):
                raise ValueError(f"request {request_id!r} is already streaming")
            self._routes.add(request_id, num_children, stream)
        return stream

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
        post({stream: [error(stream.request_id)] for stream in streams})

    def close(self) -> None:
        self._closing = True
        self._nats.close()

    def _drop(self, route: Route[RequestStream]) -> RequestStream:
        self._routes.remove(route)
        return route.target

    async def _subscribe(self) -> None:
        await self._nats.nc.subscribe(subject(self.gateway_id), cb=self._on_message)
        await self._nats.nc.flush()  # the server knows the subscription: submits may start

    async def _on_message(self, msg: Msg) -> None:
        outputs = scheduler_pb2.StepOutputs.FromString(msg.data)
        items: defaultdict[RequestStream, list[Item]] = defaultdict(list)
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
        post(items)

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
        self.fail(None, lambda request_id: RequestLost(request_id, reason))
