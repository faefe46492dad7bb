"""The embedded engine client: one EngineCore stepping on its own thread
(services/engine_thread.py), streamed to asyncio.

Results go back with one `call_soon_threadsafe` per event loop per iteration (never
one per token) into per-request asyncio queues. Each stream remembers its own loop,
so several event loops (e.g. two servers in one process) can share one engine.

A request with n or best_of > 1 runs in the engine as child requests
(`child_request_id`); every child's deltas go to the parent's stream, which ends
once every child has ended.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.engine import EngineCore, StepFailed
from services.engine_client import EngineUnavailable, RequestFailed
from services.engine_thread import EngineThread
from services.messages import TokenDelta
from services.parallel_sampling import num_children
from services.request_routes import RequestRoutes, Route
from services.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What a stream's queue carries: deltas, or the exception that ends the request.
_Item = TokenDelta | BaseException


@dataclass(eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)


@dataclass
class _Add:
    stream: _Stream
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None


def _deliver(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    """Runs on the consumer's event loop."""
    for target, item in items:
        target.put_nowait(item)


class AsyncEngine(EngineThread[_Add]):
    def __init__(self, core: EngineCore) -> None:
        super().__init__(core, "kvfleet-engine")
        # Owned by the engine thread: each live request's stream, and what to deliver.
        self._routes: RequestRoutes[_Stream] = RequestRoutes()
        self._outbox: defaultdict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = defaultdict(list)

    # -- lifecycle (any thread) ------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the loop; requests still running end with EngineUnavailable."""
        self._stop_thread()

    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    # -- requests (asyncio side) -----------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._send(_Add(stream, list(prompt_token_ids), params, cache_salt), "the engine is not running")
        # Each engine request (one, or one per child) ends with exactly one delta that
        # has a finish_reason; the engine thread guarantees it.
        running = num_children(params)
        try:
            while running:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    running = 0
                    raise item
                running -= item.finish_reason is not None
                yield item
        finally:
            if running:  # the consumer left early: free the blocks of every live child
                self._send_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (every child of it), or one child by its child id."""
        self._send_abort(request_id)

    # -- the engine thread -----------------------------------------------------------

    def _handle(self, command: _Add) -> None:
        stream = command.stream
        try:
            self.core.add_request(stream.request_id, command.prompt_token_ids, command.params, command.cache_salt)
        except Exception as exc:  # rejected input: the caller gets the error, the loop goes on
            self._post(stream, exc)
            return
        self._routes.add(stream.request_id, num_children(command.params), stream)

    def _abort(self, request_id: str) -> None:
        for engine_id in self._routes.engine_ids(request_id):
            delta = self.core.abort_request(engine_id)
            if self._routes.of(engine_id) is not None:
                # The stream counts ended children, so it gets an end even if the core had none to give.
                self._end(delta or TokenDelta(engine_id, [], "abort"))

    def _step(self) -> None:
        try:
            deltas = self.core.step()
        except StepFailed as exc:  # the core has ended the step's requests; the others run on
            logger.error("an engine step failed, ending its %d requests: %s", len(exc.request_ids), exc.__cause__)
            for engine_id in exc.request_ids:
                route = self._routes.of(engine_id)
                if route is not None:  # a parallel request fails whole, once
                    self._fail(route, RequestFailed(route.request_id, f"engine step failed: {exc.__cause__!r}"))
            return
        except Exception as exc:
            # The scheduler itself failed: its state is unknown, so every live request
            # ends, explicitly, and the loop goes on serving new ones.
            logger.exception("the engine failed; ending all %d requests", len(self._routes))
            reason = f"engine step failed: {exc!r}"
            self._fail_all(lambda request_id: RequestFailed(request_id, reason))
            return
        for delta in deltas:
            if delta.finish_reason is not None:
                self._end(delta)
            elif (route := self._routes.of(delta.request_id)) is not None:
                self._post(route.target, delta)

    def _end(self, delta: TokenDelta) -> None:
        """Posts an engine request's last delta; the stream ends with its last child."""
        route = self._routes.end(delta.request_id)
        if route is not None:
            self._post(route.target, delta)

    def _fail_all(self, error: Callable[[str], Exception]) -> None:
        for route in self._routes:
            self._fail(route, error(route.request_id))

    def _fail(self, route: Route[_Stream], error: Exception) -> None:
        """Ends a stream with `error`, aborting whatever of it the core still runs."""
        for engine_id in self._routes.remove(route):
            try:
                self.core.abort_request(engine_id)
            except Exception:
                logger.exception("could not abort %s", engine_id)
        self._post(route.target, error)

    def _close(self) -> None:
        """After the loop ends: nothing may wait forever on a stream."""
        for command in self._pending_commands():
            self._post(command.stream, EngineUnavailable("the engine shut down"))
        self._fail_all(lambda request_id: EngineUnavailable("the engine shut down"))
        self._end_iteration()
        try:
            # Nothing is left to run: these steps only tell the worker to drop the state
            # of ended requests.
            while self.core.has_work:
                self.core.step()
        except Exception:
            logger.exception("could not release the worker's request state")
        self._stats = self.core.stats()

    def _post(self, stream: _Stream, item: _Item) -> None:
        self._outbox[stream.loop].append((stream, item))

    def _end_iteration(self) -> None:
        """One call_soon_threadsafe per event loop with everything its streams got."""
        outbox, self._outbox = self._outbox, defaultdict(list)
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, [(stream.queue, item) for stream, item in items])
            except RuntimeError:  # the loop is closed: nobody reads these streams any more
                for route in self._routes:
                    if route.target.loop is loop:
                        self._fail(route, EngineUnavailable("the event loop closed"))
