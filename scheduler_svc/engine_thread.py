"""The thread an EngineCore steps on, fed through a thread-safe inbox.

EngineCore is not thread-safe, so every call to it happens on this thread. Callers
on other threads post commands (adds, aborts) to the inbox, which the thread drains
before each step; with no work it blocks on the inbox (no busy-wait). Each live
request has a route to its target (an asyncio stream, a gateway). What differs
between the embedded engine (kvfleet's AsyncEngine: asyncio streams) and the scheduler role
(StepLoop: one batch per gateway per step) is how commands are taken and outputs
delivered: the subclasses' hooks.

Failure isolation: a step whose worker call fails ends the requests that step held,
each explicitly, and the loop goes on; a failure of the scheduler itself (its state
is then unknown) ends every live request, and the loop goes on serving new ones.
"""
from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

from scheduler_svc.engine_core import EngineCore, StepFailed, WorkerLost
from services.engine_client import EngineUnavailable
from services.messages import EngineStats, TokenDelta
from services.request_routes import RequestRoutes, Route

logger = logging.getLogger(__name__)


@dataclass
class Abort:
    request_id: str


class _Stop:
    pass


Command = TypeVar("Command")
Target = TypeVar("Target")


class EngineThread(ABC, Generic[Command, Target]):
    def __init__(self, core: EngineCore, name: str) -> None:
        self.core = core
        self._name = name
        self._inbox: queue.SimpleQueue[Command | Abort | _Stop] = queue.SimpleQueue()
        # Guards `_stopped` together with puts, so nothing lands in the inbox after
        # the thread has drained it for the last time. Reentrant, so that a subclass
        # can check a state of its own and post under one hold.
        self._lock = threading.RLock()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Owned by the engine thread: where each live request's deltas go.
        self._routes: RequestRoutes[Target] = RequestRoutes()
        # Replaced (never mutated) by the engine thread, so any thread may read it.
        self._stats: EngineStats = core.stats()

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self._name} was already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        return self._stats

    def _stop_thread(self) -> None:
        """Ends the loop (then _close runs on the thread) and waits for it."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join()

    def _send(self, command: Command, refusal: str) -> None:
        """Posts a command; raises EngineUnavailable(`refusal`) once the loop is stopping."""
        with self._lock:
            if self._stopped or self._thread is None:
                raise EngineUnavailable(refusal)
            self._inbox.put(command)

    def _send_abort(self, request_id: str) -> None:
        with self._lock:
            if not self._stopped:  # after a stop the thread ends every request itself
                self._inbox.put(Abort(request_id))

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            logger.exception("%s died", self._name)
            raise
        finally:
            with self._lock:
                self._stopped = True
            self._close()

    def _serve(self) -> None:
        while True:
            for command in self._take_commands(block=not self.core.has_work):
                if isinstance(command, _Stop):
                    return
                if isinstance(command, Abort):
                    self._abort(command.request_id)
                else:
                    self._handle(command)
            if self.core.has_work:
                self._step()
            # Stats first: whoever receives a delta then sees stats at least as new as it.
            self._stats = self.core.stats()
            self._end_iteration()

    def _take_commands(self, block: bool) -> list[Command | Abort | _Stop]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _pending_commands(self) -> list[Command]:
        """After the loop ended: what was posted but never taken (aborts aside)."""
        return [c for c in self._take_commands(block=False) if not isinstance(c, (Abort, _Stop))]

    def _abort(self, request_id: str) -> None:
        """A request id aborts the request and its children; a child id, that child only."""
        for engine_id in self._routes.engine_ids(request_id):
            delta = self.core.abort_request(engine_id)
            route = self._routes.end(engine_id)
            if route is not None:  # the target counts ended children: it gets an end even if the core had none
                self._emit(route, delta or TokenDelta(engine_id, [], "abort"))

    def _step(self) -> None:
        try:
            deltas = self.core.step()
        except StepFailed as exc:  # the core has ended the step's requests; the others run on
            logger.error("an engine step failed, ending its %d requests: %s", len(exc.request_ids), exc.__cause__)
            self._fail(exc.request_ids, f"engine step failed: {exc.__cause__!r}", lost=isinstance(exc.__cause__, WorkerLost))
            return
        except Exception as exc:
            logger.exception("the scheduler failed; ending all %d requests", len(self._routes))
            self._fail(self._live_engine_ids(), f"the scheduler failed: {exc!r}")
            return
        for delta in deltas:
            route = self._routes.end(delta.request_id) if delta.finish_reason else self._routes.of(delta.request_id)
            if route is not None:
                self._emit(route, delta)

    def _live_engine_ids(self) -> list[str]:
        return [engine_id for route in self._routes for engine_id in sorted(route.live)]

    def _abort_in_core(self, engine_ids: list[str]) -> None:
        """Frees what the core still holds of these requests, whatever state it is in."""
        for engine_id in engine_ids:
            try:
                self.core.abort_request(engine_id)
            except Exception:
                logger.exception("could not abort %s", engine_id)

    def _release_worker(self) -> None:
        """After the loop: steps with nothing left to run tell the worker every request
        that ended, so it holds no state for a loop that has gone (a draining worker waits for it)."""
        try:
            while self.core.has_work:
                self.core.step()
        except Exception as exc:  # the worker may be what failed
            logger.warning("could not tell the worker which requests ended: %r", exc)

    @abstractmethod
    def _emit(self, route: Route[Target], delta: TokenDelta) -> None:
        """Queues a delta for the route's target (delivered at the end of the iteration)."""

    @abstractmethod
    def _fail(self, engine_ids: list[str], reason: str, lost: bool = False) -> None:
        """Ends these engine requests (and what else of their requests must end) with an
        explicit error; `lost`: what failed is what carried them (the worker was lost,
        the scheduler shut down), not the requests (RequestLost, a 503)."""

    @abstractmethod
    def _handle(self, command: Command) -> None:
        """Takes one command other than an abort."""

    @abstractmethod
    def _end_iteration(self) -> None:
        """After each pass through the loop: deliver what the step produced."""

    @abstractmethod
    def _close(self) -> None:
        """After the loop ended: every caller and every live request hears so."""
