"""Requests that outlive their replica.

When the replica running a request dies (its worker or its scheduler), the gateway
submits the request to another replica with the tokens generated so far as its
output (SubmitRequest.output_token_ids), and the client's stream goes
on: no token lost, repeated or reordered; greedy text as an uninterrupted run gives,
and seeded sampling draws what it would have drawn. `--migration-limit` caps the
re-submissions of one request (0: none). When no other replica can take it, the client
gets the original error at once: a replica's death reaches its clients within a second.
With `--migration-wait S` the request waits up to S seconds for a replica instead, its
own included once its worker or scheduler is restarted (a lone replica under a
supervisor: `cluster up`, a pod's restart), and its stream goes on there.

The journal (prompt, sampling params, tokens emitted) is this coroutine's state, in
the gateway: it holds the client's connection, so when a gateway dies its clients'
streams die with it and there is nothing left to continue; keeping the journal in
Redis would only add a write per step. Requests with n or best_of > 1 are not
migrated (each child would need its own journal): they end with the error, as before.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from services.engine_client import EngineUnavailable, RequestLost
from services.invalid_parameter import InvalidParameter
from services.messages import TokenDelta
from services.parallel_sampling import num_children
from services.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MIGRATION_LIMIT = 3
# How often a lost request waiting for a replica tries again: the gateway polls its
# replicas twice a second.
_RETRY_INTERVAL_S = 0.25

# One placement of the request: given the tokens it already generated, and the replicas
# tried so far (it adds the one it uses, and avoids them while others can take it),
# the deltas of its new tokens.
Attempt = Callable[[list[int], set], AsyncIterator[TokenDelta]]


async def migrating(attempt: Attempt, request_id: str, params: SamplingParams, limit: int, wait_s: float
                    ) -> AsyncIterator[TokenDelta]:
    """The request's deltas, placed again (up to `limit` times) when what carried it fails;
    `wait_s`: how long a lost request waits for a replica that can take it."""
    emitted: list[int] = []
    tried: set = set()
    failure: RequestLost | None = None  # what ended the last placement
    lost_at = 0.0
    migrations = 0
    while True:
        started = False
        try:
            async for delta in attempt(list(emitted), tried):
                started = True
                emitted.extend(delta.new_token_ids)
                yield delta
            return
        except (EngineUnavailable, InvalidParameter) as refused:
            if failure is None or started:
                raise
            if isinstance(refused, EngineUnavailable) and time.monotonic() - lost_at < wait_s:
                await asyncio.sleep(_RETRY_INTERVAL_S)  # no replica can take it yet: one may come
                continue
            raise failure from refused  # no replica can take it (or no room is left): the original error
        except RequestLost as exc:  # what carried it failed (its worker or scheduler), not the request
            if migrations >= limit or num_children(params) > 1:
                raise
            if params.max_tokens is not None and len(emitted) >= params.max_tokens:
                yield TokenDelta(request_id, [], "length")  # it was done: only its end was lost
                return
            migrations += 1
            logger.warning("request %s: %s; migrating it with %d tokens generated (migration %d of at most %d)",
                           request_id, exc, len(emitted), migrations, limit)
            failure, lost_at = exc, time.monotonic()
