"""What the gateway needs from an engine, whatever carries it.

Embedded mode implements it with `AsyncEngine` (an EngineCore on its own thread);
the cluster transports (gRPC submit/abort, NATS token stream) implement the same
interface, so the gateway never knows which one it talks to.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import EngineInfo, EngineStats, TokenDelta
from services.sampling_params import SamplingParams


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started, shut down, or its loop died)."""


class EngineOverloaded(EngineUnavailable):
    """Every replica's queue is full (--max-queued-requests): a 429, and sent again a
    little later the request may well be served. Running requests are untouched."""

    retry_after_s = 1


class RequestFailed(RuntimeError):
    """The engine ended a request with an internal error; the request is aborted."""

    finish_reason = "abort"

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class RequestLost(RequestFailed):
    """A part of the cluster that carried the request went away (its scheduler died,
    the token stream broke): nothing was wrong with the request, and sent again it
    may well be served (a 503, where an internal error is a 500)."""


class EngineClient(Protocol):
    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def is_ready(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    async def refresh_stats(self) -> None:
        """Brings stats() up to the engine's state at this call, for a /metrics scrape that
        must see every request that ended before it. Embedded, stats() always is: the engine
        thread renews them before it delivers any delta. A cluster asks its schedulers."""

    def engine_info(self) -> EngineInfo | None:
        """None until the engine is known (a cluster's first scheduler has registered)."""

    # Implemented as an async generator (`async def` with `yield`), hence `def` here.
    # Yields deltas in order (each may carry several tokens); the last one has a
    # finish_reason. With n or best_of > 1 the request runs as child requests: each
    # delta keeps its child's id (`child_request_id(request_id, i)`, so i is the
    # choice), every child ends with one delta that has a finish_reason, and the
    # stream ends when all have. Rejected input raises InvalidParameter / ValueError
    # from the first iteration, an internal failure raises RequestFailed. Closing the
    # generator before its end aborts every child still running. `cache_salt` keeps
    # the request's prefix-cache entries apart from those of other salts.
    # `kv_transfer_params`: vLLM's, for prefill/decode disaggregation (docs/disaggregation.md).
    # `lora_request`: the adapter it runs with (docs/lora.md); None: the base model.
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        kv_transfer_params: KvTransferParams | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]: ...

    # A request id aborts the request and all its children; a child id, that child only.
    async def abort(self, request_id: str) -> None: ...

    # Reads and checks an adapter where the engine runs; ValueError naming what is wrong.
    async def add_lora(self, lora_request: LoRARequest) -> None: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...

    def lora_requests(self) -> dict[str, LoRARequest]:
        """Adapters served beyond those this front end loaded (a cluster's other gateways'), by name."""
