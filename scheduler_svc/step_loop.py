"""The scheduler role's engine thread (scheduler_svc/engine_thread.py): one EngineCore fed
by gRPC handler threads, publishing each step's deltas per gateway. After each
iteration every gateway with new deltas gets one batch: never one message per token.

A request that fails ends with a final ABORT delta carrying the error. A lost worker
(dead, or restarted with an empty cache) ends every request; once a worker answers
at that address again, new requests run on it.
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from scheduler_svc.block_pool import KvEventLog
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.engine_thread import EngineThread
from scheduler_svc.output_hub import OutputHub
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.messages import TokenDelta
from services.parallel_sampling import num_children
from services.request_routes import Route
from services.scheduler_messages import SubmitRequest

logger = logging.getLogger(__name__)


@dataclass
class _Submit:
    request: SubmitRequest
    accepted: Future[None]


@dataclass
class _Drain:
    idle: threading.Event  # set once the engine has nothing left to do


@dataclass
class _CheckWorker:
    """The worker link came back: see whether it is the worker we knew."""

    answered: Future[bool]  # whether the worker answered the engine's own client


@dataclass
class _FlushCache:
    """Forget the prefix cache (vLLM's reset_prefix_cache), only while no request is in
    the engine: a live request's blocks are in use."""

    flushed: Future[bool]


class StepLoop(EngineThread[_Submit | _Drain | _CheckWorker | _FlushCache, str]):
    def __init__(self, core: EngineCore, hub: OutputHub, max_queued_requests: int | None = None) -> None:
        """`max_queued_requests`: past this many waiting requests, new ones are refused
        (EngineOverloaded) and running ones go on; None: no bound."""
        super().__init__(core, "kvfleet-step-loop")
        self._hub = hub
        self.max_queued_requests = max_queued_requests
        self._draining = False  # guarded by _lock: once set, Submits are refused
        # Owned by the loop thread: set from drain(), the event to set once idle.
        self._idle_event: threading.Event | None = None
        # Owned by the loop thread: the deltas not yet published, per gateway.
        self._outputs: defaultdict[str, list[TokenDelta]] = defaultdict(list)
        # The prefix cache's changes, when the hub has routers to tell.
        self._kv_log: KvEventLog | None = None
        if hub.kv_events is not None:
            self._kv_log = KvEventLog()
            core.scheduler.attach_kv_events(self._kv_log)

    # -- any thread ----------------------------------------------------------------------

    def stop(self) -> None:
        """Ends the loop; live requests end with an ABORT delta saying so."""
        self._stop_thread()

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, timeout_s: float) -> bool:
        """Refuses new requests (EngineUnavailable) while the live ones run on, up to
        `timeout_s`, then stops the loop: those still running end with an ABORT delta
        saying so. Returns whether every request finished in time."""
        idle = threading.Event()
        with self._lock:
            running = not self._stopped and self._thread is not None
            if running:
                self._draining = True
                # Through the inbox, so the loop sees every Submit accepted before it.
                self._inbox.put(_Drain(idle))
        drained = idle.wait(timeout_s) if running else True
        self.stop()
        return drained

    def submit(self, requests: Sequence[SubmitRequest]) -> list[Future[None]]:
        """Posts the requests together, so the loop takes them in one pass. Each future
        resolves once the engine has queued its request, or raises InvalidParameter or
        ValueError for rejected input. Raises EngineUnavailable once the loop is stopping."""
        commands = [_Submit(request, Future()) for request in requests]
        with self._lock:  # reentrant: _send takes it too, so no drain slips in between
            if self._draining:
                raise EngineUnavailable("the scheduler is draining: it takes no new requests")
            for command in commands:
                self._send(command, "the scheduler is shutting down")
        return [command.accepted for command in commands]

    def abort(self, request_id: str) -> None:
        self._send_abort(request_id)

    def check_worker(self) -> Future[bool]:
        """Ahead of anything posted after it, the loop checks the worker's identity; the
        future says whether the worker answered."""
        command = _CheckWorker(Future())
        self._send(command, "the scheduler is shutting down")
        return command.answered

    def flush_cache(self) -> Future[bool]:
        """The future says whether the prefix cache was emptied (no request was in the engine)."""
        command = _FlushCache(Future())
        self._send(command, "the scheduler is shutting down")
        return command.flushed

    # -- the loop thread -----------------------------------------------------------------

    def _handle(self, command: _Submit | _Drain | _CheckWorker | _FlushCache) -> None:
        if isinstance(command, _Drain):
            self._idle_event = command.idle
        elif isinstance(command, _FlushCache):
            idle = not self.core.scheduler.has_unfinished_requests
            if idle:
                self.core.scheduler.block_pool.reset_prefix_cache()
            command.flushed.set_result(idle)
        elif isinstance(command, _CheckWorker):
            ended = self.core.check_worker()
            if ended:
                self._fail(ended, "the worker restarted: its KV cache is gone", lost=True)
            command.answered.set_result(ended is not None)
        else:
            self._submit(command)

    def _end_iteration(self) -> None:
        self._publish()
        if self._kv_log is not None and (events := self._kv_log.take()) is not None:
            self._hub.kv_events.publish(events)
        self._check_drained()

    def _submit(self, command: _Submit) -> None:
        new = command.request
        waiting = len(self.core.scheduler.waiting)
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            command.accepted.set_exception(
                EngineOverloaded(f"the scheduler's queue is full ({waiting} requests waiting)"))
            return
        try:
            self.core.add_request(new.request_id, new.prompt_token_ids, new.sampling_params, new.cache_salt,
                                  new.output_token_ids, new.kv_transfer_params, new.lora_request)
        except Exception as exc:  # rejected input: the caller gets the error, the loop goes on
            command.accepted.set_exception(exc)
            return
        # With n or best_of > 1 the deltas carry each child's id; the gateway gathers them.
        self._routes.add(new.request_id, num_children(new.sampling_params), new.gateway_id)
        command.accepted.set_result(None)

    def _emit(self, route: Route[str], delta: TokenDelta) -> None:
        self._outputs[route.target].append(delta)

    def _fail(self, engine_ids: list[str], reason: str, lost: bool = False) -> None:
        self._abort_in_core(engine_ids)
        for engine_id in engine_ids:
            route = self._routes.end(engine_id)
            if route is not None:
                self._outputs[route.target].append(TokenDelta(engine_id, [], "abort", error=reason, lost=lost))

    def _publish(self) -> None:
        if not self._outputs:
            return
        outputs, self._outputs = self._outputs, defaultdict(list)
        for gateway_id in self._hub.publish(outputs):
            # Nobody will read these requests' tokens.
            orphans = [route for route in self._routes if route.target == gateway_id]
            logger.warning("gateway %s is gone (its stream closed, or its lease lapsed); aborting its %d requests",
                           gateway_id, len(orphans))
            for route in orphans:
                self._abort_in_core(self._routes.remove(route))
            # The loop may now sleep until the next command: Stats must not keep showing them.
            self._stats = self.core.stats()

    def _check_drained(self) -> None:
        # has_work covers the drops the worker has yet to hear of, so a drained
        # worker holds no request state either.
        if self._idle_event is not None and not self.core.has_work:
            self._idle_event.set()

    def _close(self) -> None:
        """After the loop ends: every caller and every live request hears so."""
        for command in self._pending_commands():
            if isinstance(command, _Submit):
                command.accepted.set_exception(EngineUnavailable("the scheduler is shutting down"))
        self._fail(self._live_engine_ids(), "the scheduler shut down", lost=True)
        self._release_worker()
        self._publish()
        self._hub.close()
        if self._idle_event is not None:  # a drain() still waiting: there is nothing left to wait for
            self._idle_event.set()
