"""Prefill/decode disaggregation, the gateway's part (docs/disaggregation.md).

Replicas register their side (`kv_role` in their lease, from --kv-transfer-config): the
prefill pool is the kv_producer and kv_both replicas, the decode pool every other one; a
kv_both replica given a pool (`kv_pool` in its lease, which the planner may change) is in
that one only.
For each request the decode replica is chosen first, by the routing policy, as any
request is placed. If that replica can fetch KV (kv_consumer, kv_both) and the part of
the prompt it does not hold (its device pool and offload tiers, as the prefix index
sees them) is more than `--pd-min-prefill-tokens`, and (with `--pd-max-prefill-queue`)
some prefill replica has fewer requests waiting than that, a prefill replica is chosen
the same way among the prefill pool, and asked to compute the prompt's KV and hold it (vLLM's
`do_remote_decode`, one token asked); its `kv_transfer_params` go with the request to
the decode replica, whose worker fetches the full blocks it lacks straight from the
prefill replica's worker. The blocks move as they are computed (kvfleet's
`remote_streamed`): the prefill replica says where they wait after its first chunk, the
decode request is submitted then, and its worker fetches each block as the prefill
publishes it, while the next chunks compute. If the prefill leg fails, the decode
replica computes what did not arrive: the client sees the same text either way.

Requests that carry their own kv_transfer_params (vLLM's disaggregation proxy, llm-d's
sidecar) are placed as they say and never split again; nor are resumed (migrated)
requests, parallel samples, those that want prompt logprobs (every position must be
computed where they decode) and pooling requests (docs/pooling.md: they pool every
position's hidden state where they run). An adapter's request (docs/lora.md) runs its
prefill leg with the same adapter.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import msgspec

from services.engine_client import EngineUnavailable, RequestFailed
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import FirstTokenTimes, TokenDelta
from services.parallel_sampling import num_children
from services.sampling_params import SamplingParams

if TYPE_CHECKING:  # the gateway's --help imports this module for its default: no grpc then
    from gateway.cluster.replica import Replica

logger = logging.getLogger(__name__)

# Up to this many uncached prompt tokens the decode replica prefills itself: one block.
# Only full blocks move, so a split of a prompt with at most a block uncached would move
# nothing and the decode replica would compute the same tokens; past one block, each
# block moved saves the decode replica its compute for the price of its fetch, which on
# this project's 2-core CPU is about 50 ms against 3 ms for a 16-token block of the
# default model (docs/disaggregation.md). So every split prompt leaves the decode replica
# at most its last partial block. A deployment that would rather keep short prompts
# local (a split adds a second request's trip through a scheduler to the time to first
# token) raises it.
DEFAULT_PD_MIN_PREFILL_TOKENS = 16
_LEG_WAIT_S = 2.0
PREFILL_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")

# Places one request on a replica of a pool; the request streams' place(), bound.
Place = Callable[..., AsyncIterator[TokenDelta]]


def decodes(replica: Replica) -> bool:
    """In the decode pool: every replica but a prefill-only one."""
    return replica.kv_role != "kv_producer" and replica.kv_pool != "prefill"


def prefills(replica: Replica) -> bool:
    return replica.kv_role in PREFILL_ROLES and replica.kv_pool != "decode"


class PrefillLeg:
    """The prefill replica's request, run to its end beside the decode request."""

    def __init__(self) -> None:
        self.times: FirstTokenTimes | None = None  # its queue and prefill, measured there
        self.task: asyncio.Task[None] | None = None

    async def finished(self) -> FirstTokenTimes | None:
        """Its times, once it ended: by the decode's first token it nearly always has (its
        last chunk came before the last block); a leg its replica left hanging holds the
        decode's first token back no longer than a moment, and has no times then."""
        if self.task is not None:
            await asyncio.wait([self.task], timeout=_LEG_WAIT_S)
        return self.times

    def cancel(self) -> None:
        """The decode request ended first (failed, or its client left): the prefill stops."""
        if self.task is not None:
            self.task.cancel()


class Disaggregation:
    def __init__(self, min_prefill_tokens: int, stream_blocks: bool = True, max_prefill_queue: int | None = None
                 ) -> None:
        self.min_prefill_tokens = min_prefill_tokens
        # Past this many requests waiting on every prefill replica, the decode replica
        # computes the prompt itself (NVIDIA Dynamo's conditional disaggregation): a queue
        # that long costs the time to first token more than the prompt's compute costs the
        # decode replica's other streams. None: no bound.
        self.max_prefill_queue = max_prefill_queue
        # Blocks move as the prefill computes them, not after it (remote_streamed).
        self.stream_blocks = stream_blocks

    def wants_prefill(self, decode: Replica, uncached_tokens: int, prefill_pool: list[Replica],
                      params: SamplingParams) -> bool:
        return (decode.kv_role in CONSUMER_ROLES and uncached_tokens > self.min_prefill_tokens
                and any(replica is not decode and (self.max_prefill_queue is None
                                                   or replica.waiting < self.max_prefill_queue)
                        for replica in prefill_pool)
                and num_children(params) == 1 and params.prompt_logprobs is None
                # a pooling request needs every prompt position's hidden state where it pools
                and params.pooling is None)

    async def prefill(self, place: Place, request_id: str, prompt_token_ids: list[int], cache_salt: str | None,
                      decode: Replica, lora_request: LoRARequest | None = None,
                      ) -> tuple[KvTransferParams | None, PrefillLeg]:
        """Has a prefill replica compute the prompt's KV and hold it; returns where it waits
        as soon as the prefill replica says so (after its first chunk when the blocks
        stream, else at its end), and the leg, which runs on to its end. None when it
        failed first: the decode replica then computes the prompt. With an adapter's
        request the prefill leg runs the same adapter: its KV depends on it."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        hold = KvTransferParams(do_remote_decode=True, remote_streamed=self.stream_blocks)
        started = time.monotonic()
        announced: asyncio.Future[KvTransferParams | None] = asyncio.get_running_loop().create_future()
        leg = PrefillLeg()

        async def run() -> None:
            try:
                async with aclosing(place(f"{request_id}-prefill", prompt_token_ids, params, cache_salt, [], {decode},
                                          kv_transfer_params=hold, pool=prefills, lora_request=lora_request)) as deltas:
                    async for delta in deltas:
                        leg.times = delta.first_token_times or leg.times
                        if delta.kv_transfer_params is not None and not announced.done():
                            announced.set_result(delta.kv_transfer_params)
            except (EngineUnavailable, RequestFailed) as exc:  # full, gone, or its step failed: not the request's fault
                logger.warning("request %s: the prefill replica failed (%s); the decode replica computes what it "
                               "lacks", request_id, exc)
            finally:
                if not announced.done():
                    announced.set_result(None)

        leg.task = asyncio.create_task(run())
        try:
            handoff = await announced
        except asyncio.CancelledError:
            leg.cancel()
            raise
        if handoff is None:
            logger.warning("request %s: the prefill replica held no KV (is it a kv_producer?) after %.3f s; the decode "
                           "replica computes the prompt", request_id, time.monotonic() - started)
        return handoff, leg


def with_remote_times(delta: TokenDelta, remote: FirstTokenTimes | None) -> TokenDelta:
    """The decode replica's first delta, its times completed by the prefill leg's."""
    if remote is None or delta.first_token_times is None:
        return delta
    times = msgspec.structs.replace(delta.first_token_times, remote_queued_s=remote.queued_s,
                                    remote_prefill_s=remote.prefill_s)
    return msgspec.structs.replace(delta, first_token_times=times)
