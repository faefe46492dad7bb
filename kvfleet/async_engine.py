"""The embedded engine client: one EngineCore stepping on its own thread
(scheduler_svc/engine_thread.py), streamed to asyncio.

Results go back with one `call_soon_threadsafe` per event loop per iteration (never
one per token) into each request's RequestStream. Each stream remembers its own
loop, so several event loops (e.g. two servers in one process) can share one engine.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from scheduler_svc.engine_core import EngineCore
from scheduler_svc.engine_thread import EngineThread
from services.engine_client import EngineUnavailable, RequestFailed, RequestLost
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import EngineInfo, TokenDelta
from services.parallel_sampling import num_children
from services.request_routes import Route
from services.request_stream import Item, RequestStream, post
from services.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    lora_request: LoRARequest | None = None


class AsyncEngine(EngineThread[_Add, RequestStream]):
    def __init__(self, core: EngineCore) -> None:
        super().__init__(core, "kvfleet-engine")
        self._info = EngineInfo(core.max_model_len, core.eos_token_ids, core.description.pooler)
        # Owned by the engine thread: what to deliver at the end of this iteration.
        self._outbox: defaultdict[RequestStream, list[Item]] = defaultdict(list)

    # -- lifecycle (any thread) ------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the loop; requests still running end with EngineUnavailable."""
        self._stop_thread()

    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def engine_info(self) -> EngineInfo:
        return self._info

    async def refresh_stats(self) -> None:
        """stats() is always current: the engine thread renews them before it delivers a delta."""

    # -- requests (asyncio side) -----------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        kv_transfer_params: KvTransferParams | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """`kv_transfer_params` change nothing here: the embedded engine has no worker another
        replica could fetch from, nor one to fetch with (serve refuses --kv-transfer-config)."""
        stream = RequestStream(request_id, num_children(params))
        if params.structured_outputs is not None:  # off the loop: a new grammar takes milliseconds to compile
            await asyncio.to_thread(self.core.compile_grammar, params)
        self._send(_Add(stream, list(prompt_token_ids), params, cache_salt, lora_request), "the engine is not running")
        try:
            async for delta in stream.deltas():
                yield delta
        finally:
            if stream.unfinished:  # the consumer left early: free the blocks of every live child
                self._send_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (every child of it), or one child by its child id."""
        self._send_abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        # Off the loop and off the engine thread: reading an adapter takes milliseconds to seconds.
        await asyncio.to_thread(self.core.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await asyncio.to_thread(self.core.remove_lora, lora_int_id)

    def lora_requests(self) -> dict[str, LoRARequest]:
        return {}  # one front end: its own adapters are all there are

    # -- the engine thread -----------------------------------------------------------

    def _handle(self, command: _Add) -> None:
        stream = command.stream
        try:
            self.core.add_request(stream.request_id, command.prompt_token_ids, command.params, command.cache_salt,
                                  lora_request=command.lora_request)
        except Exception as exc:  # rejected input: the caller gets the error, the loop goes on
            self._outbox[stream].append(exc)
            return
        self._routes.add(stream.request_id, num_children(command.params), stream)

    def _emit(self, route: Route[RequestStream], delta: TokenDelta) -> None:
        self._outbox[route.target].append(delta)

    def _fail(self, engine_ids: list[str], reason: str, lost: bool = False) -> None:
        failure = RequestLost if lost else RequestFailed
        for engine_id in engine_ids:
            route = self._routes.of(engine_id)
            if route is not None:  # a parallel request fails whole, once
                self._end_stream(route, failure(route.request_id, reason))

    def _end_stream(self, route: Route[RequestStream], error: Exception) -> None:
        """Ends a stream with `error`, aborting whatever of it the core still runs."""
        self._abort_in_core(self._routes.remove(route))
        self._outbox[route.target].append(error)

    def _close(self) -> None:
        """After the loop ends: nothing may wait forever on a stream."""
        for command in self._pending_commands():
            self._outbox[command.stream].append(EngineUnavailable("the engine shut down"))
        for route in self._routes:
            self._end_stream(route, EngineUnavailable("the engine shut down"))
        self._end_iteration()
        self._release_worker()
        self._stats = self.core.stats()

    def _end_iteration(self) -> None:
        """One call_soon_threadsafe per event loop with everything its streams got."""
        outbox, self._outbox = self._outbox, defaultdict(list)
        for loop in post(outbox):  # closed: nobody reads these streams any more
            for route in self._routes:
                if route.target.loop is loop:
                    self._end_stream(route, EngineUnavailable("the event loop closed"))
