"""A gateway's end of the token stream: one NATS subscription to `kvfleet.out.<gateway_id>`,
demultiplexed into per-request RequestStreams (services/request_stream.py), fed with
one `call_soon_threadsafe` per loop per NATS message (never one per token).

Core NATS is at-most-once, so each scheduler numbers its messages to us: a hole in the
numbers (a NATS restart, a message the client had to drop, a scheduler announcing a
tail we never got) is filled by a replay over gRPC from that scheduler
(gateway/cluster/step_sequence.py, Scheduler.ReplayOutputs), and the streams go on intact.
Streams fail only when NATS stays away longer than `grace_s`, or a scheduler can no
longer replay what is missing (then its ReplaySource fails that scheduler's requests).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import msgspec
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError

from gateway.cluster.step_sequence import StepSequence
from services.engine_client import EngineUnavailable, RequestFailed, RequestLost
from services.messages import TokenDelta
from services.nats_link import NatsThread, subject
from services.parallel_sampling import engine_request_ids
from services.request_routes import RequestRoutes, Route
from services.request_stream import Item, RequestStream, post
from services.scheduler_messages import StepOutputs

logger = logging.getLogger(__name__)

_decode_outputs = msgspec.msgpack.Decoder(StepOutputs).decode


class ReplaySource(Protocol):
    """Who can send a scheduler's messages again: the gateway's cluster client."""

    def replay(self, instance_id: str, after_seq: int) -> list[StepOutputs] | None:
        """That scheduler's messages to us numbered after `after_seq`; None when it
        cannot say (gone, or they are no longer held), having failed the requests
        of ours it held."""

    def instances(self) -> Iterable[str]:
        """The schedulers that hold requests of ours."""


class OutputSubscriber:
    def __init__(self, url: str, gateway_id: str, source: ReplaySource, grace_s: float = 10.0,
                 connect_timeout_s: float = 10.0) -> None:
        self.gateway_id = gateway_id
        self._source = source
        self._grace_s = grace_s
        # Guards the tables below, which the NATS thread, replay threads and the consumers' loops share.
        self._lock = threading.Lock()
        self._routes: RequestRoutes[RequestStream] = RequestRoutes()
        self._sequences: defaultdict[str, StepSequence] = defaultdict(StepSequence)  # by scheduler instance
        self._expected: dict[str, str] = {}  # request id -> the scheduler instance it runs on
        self._give_up: asyncio.TimerHandle | None = None
        self._closing = False
        self._nats = NatsThread(url, "kvfleet-nats-subscriber", connect_timeout_s, disconnected_cb=self._on_disconnect,
                                reconnected_cb=self._on_reconnect, error_cb=self._on_error)
        self._nats.run(self._subscribe(), connect_timeout_s)

    @property
    def connected(self) -> bool:
        """Connected, or away from NATS for less than the grace: what is sent meanwhile
        is replayed once it is back."""
        return not self._closing and self._nats.away_s() < self._grace_s

    def open(self, request_id: str, num_children: int = 1) -> RequestStream:
        """Call on the consumer's loop, before the request is submitted, so no delta is
        missed. `num_children`: with n or best_of > 1, its deltas carry child ids."""
        stream = RequestStream(request_id, num_children)
        with self._lock:
            # Under the lock: NATS staying away past the grace after this check fails the stream (_expire).
            if not self.connected:
                raise EngineUnavailable("the token stream (NATS) is disconnected")
            ids = engine_request_ids(request_id, num_children)
            if self._routes.get(request_id) is not None or any(self._routes.of(i) is not None for i in ids):
                raise ValueError(f"request {request_id!r} is already streaming")
            self._routes.add(request_id, num_children, stream)
        return stream

    def expect(self, request_id: str, instance_id: str) -> None:
        """The open request runs on this scheduler: deltas for it from any other (one it
        ran on before it was migrated, say) are dropped."""
        with self._lock:
            self._expected[request_id] = instance_id

    def discard(self, request_id: str) -> None:
        """Stops routing the request's deltas (it ended, or its consumer left)."""
        with self._lock:
            self._expected.pop(request_id, None)
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
        self._accept(_decode_outputs(msg.data))

    def _accept(self, outputs: StepOutputs) -> None:
        """Any thread: from NATS, or from a replay."""
        with self._lock:
            sequence = self._sequences[outputs.scheduler_instance_id]
            self._deliver(sequence.accept(outputs))
            if sequence.has_hole:
                self._replay(outputs.scheduler_instance_id)

    def _deliver(self, messages: Sequence[StepOutputs]) -> None:
        """Under the lock, so that messages of one scheduler reach their streams in order."""
        items: defaultdict[RequestStream, list[Item]] = defaultdict(list)
        for outputs in messages:
            for delta in outputs.deltas:
                route = self._routes.of(delta.request_id)
                if route is None:  # ended here already (e.g. its client left): drop
                    continue
                if self._expected.get(route.target.request_id, outputs.scheduler_instance_id) != (
                        outputs.scheduler_instance_id):  # from where it ran before it was migrated
                    continue
                stream = route.target
                if delta.error:  # one engine request failed: the whole request does
                    if delta.new_token_ids:
                        items[stream].append(TokenDelta(delta.request_id, delta.new_token_ids, logprobs=delta.logprobs))
                    failure = RequestLost if delta.lost else RequestFailed
                    items[stream].append(failure(stream.request_id, delta.error))
                    self._drop(route)
                    continue
                items[stream].append(delta)
                if delta.finish_reason is not None:
                    self._routes.end(delta.request_id)
        post(items)

    def _replay(self, instance_id: str) -> None:
        """Under the lock: fills the scheduler's hole on a thread of its own (a gRPC call)
        unless a replay of it is under way already (which checks for holes when done)."""
        sequence = self._sequences[instance_id]
        if not sequence.replaying:
            sequence.replaying = True
            threading.Thread(target=self._replay_until_whole, args=(instance_id, sequence),
                             name="kvfleet-nats-replay", daemon=True).start()

    def _replay_until_whole(self, instance_id: str, sequence: StepSequence) -> None:
        while True:
            with self._lock:
                after = sequence.delivered
            replayed = self._source.replay(instance_id, after)
            with self._lock:
                for outputs in replayed or ():
                    self._deliver(sequence.accept(outputs))
                if not sequence.has_hole:
                    sequence.replaying = False
                    return
                if replayed is None or sequence.delivered == after:  # it cannot be filled
                    logger.warning("gateway %s: messages %d+ of scheduler %s are lost", self.gateway_id, after + 1,
                                   instance_id)
                    self._deliver(sequence.skip_hole())
                    sequence.replaying = False
                    return

    def _resync(self) -> None:
        """Asks every scheduler we hear from, or have requests on, for what we may have missed."""
        holding = set(self._source.instances())
        with self._lock:
            for instance_id in holding | set(self._sequences):
                self._replay(instance_id)

    async def _on_disconnect(self) -> None:
        if self._closing:
            return
        logger.warning("gateway %s: the token stream (NATS) is disconnected; waiting up to %g s for it",
                       self.gateway_id, self._grace_s)
        self._give_up = self._nats.loop.call_later(self._grace_s, self._expire)

    async def _on_reconnect(self) -> None:
        if self._give_up is not None:
            self._give_up.cancel()
        logger.info("gateway %s: the token stream (NATS) is back; replaying what was missed", self.gateway_id)
        self._resync()

    def _expire(self) -> None:
        if not self._nats.connected:  # messages published while we were away are gone for good
            self._fail_all(f"the token stream (NATS) was disconnected for more than {self._grace_s:g} s")

    async def _on_error(self, error: Exception) -> None:
        if isinstance(error, SlowConsumerError):  # the client dropped a message: get it again
            logger.warning("gateway %s fell behind its token stream (NATS slow consumer); replaying", self.gateway_id)
            self._resync()
        else:
            logger.warning("NATS: %r", error)

    def _fail_all(self, reason: str) -> None:
        logger.warning("gateway %s: %s; failing its open requests", self.gateway_id, reason)
        self.fail(None, lambda request_id: RequestLost(request_id, reason))
