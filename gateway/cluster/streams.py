"""Our requests' streams through the cluster.

A request's stream opens on this gateway's NATS subscription, then the request goes to
the replica placement chose, over gRPC (batched with those that arrive together:
gateway/cluster/submit_batcher.py), and the deltas NATS brings back are yielded. A
replica that refuses it (full, draining, replaced) passes it to another; one that holds
it when the consumer leaves is told to abort it. Messages NATS lost are sent again by
their scheduler (this is the subscriber's ReplaySource).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import msgspec

from gateway.cluster.disaggregation import Disaggregation, decodes, prefills, with_remote_times
from gateway.cluster.nats_subscriber import OutputSubscriber
from gateway.cluster.pass_batcher import PassBatcher
from gateway.cluster.placement import Placement
from gateway.cluster.replica import Replica
from gateway.cluster.replica_set import ReplicaSet
from gateway.cluster.submit_batcher import Scheduler, SubmitRefused, submit_batch
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.parallel_sampling import engine_request_ids, num_children
from services.registry import Member
from services.sampling_params import SamplingParams
from services.scheduler_messages import AbortRequest, ReplayOutputsRequest, StepOutputs, SubmitRequest
from services.transport.futures import invalid_argument

logger = logging.getLogger(__name__)

# Submit refusals after which another replica may take the request.
_TRY_ANOTHER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RequestStreams:
    def __init__(self, gateway_id: str, replicas: ReplicaSet, placement: Placement, submit_timeout_s: float,
                 disaggregation: Disaggregation) -> None:
        self.gateway_id = gateway_id
        self._replicas = replicas
        self._placement = placement
        self._pd = disaggregation
        self._lock = replicas.lock
        self._placed = replicas.placed
        self._submit_timeout_s = submit_timeout_s
        self._aborts: set[grpc.Future] = set()  # in flight; held so they are not collected
        self._batcher: PassBatcher[Scheduler, SubmitRequest, None] = PassBatcher(submit_batch(submit_timeout_s))

    def start(self, nats_url: str, lease_ttl_s: float) -> None:
        # NATS away for a lease TTL fails our streams, as a scheduler's lease lapsing would.
        self._subscriber = OutputSubscriber(nats_url, self.gateway_id, self, grace_s=lease_ttl_s)

    def close(self) -> None:
        self._subscriber.fail(None, lambda request_id: EngineUnavailable("the gateway is shutting down"))
        self._subscriber.close()

    @property
    def connected(self) -> bool:
        return self._subscriber.connected

    def fail(self, request_ids: Sequence[str] | None, error: Callable[[str], BaseException]) -> None:
        self._subscriber.fail(request_ids, error)

    async def place(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None,
        resumed: list[int], tried: set[Replica], kv_transfer_params: KvTransferParams | None = None,
        pool: Callable[[Replica], bool] = decodes, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """One placement of the request on a replica of `pool` (gateway/cluster/migration.py);
        `resumed`: the tokens it generated on replicas that died. A long uncached prompt is
        first prefilled on a prefill replica (gateway/cluster/disaggregation.py), unless the
        request carries its own `kv_transfer_params` (vLLM's)."""
        # With n or best_of > 1 the scheduler runs child requests; each ends with one final delta.
        count = num_children(params)
        # Placed by its own id and its children's: an abort may name either.
        placed = list(dict.fromkeys([request_id, *engine_request_ids(request_id, count)]))
        stream = self._subscriber.open(request_id, count)  # before Submit: no delta can slip past
        submit: asyncio.Future[None] | None = None
        prefill_leg = None  # a split request's prefill replica request, running beside this one
        try:
            replica = self._placement.claim(placed, prompt_token_ids, cache_salt, tried, pool, lora_request)
            if resumed:  # the prompt's logprobs went out with its first delta
                params = msgspec.structs.replace(params, prompt_logprobs=None)
            if kv_transfer_params is None and pool is decodes and not resumed and self._pd.wants_prefill(
                    replica, len(prompt_token_ids) - self._placement.cached_tokens(replica, prompt_token_ids, cache_salt,
                                                                                   lora_request),
                    self._placement.routable_in(prefills), params):
                kv_transfer_params, prefill_leg = await self._pd.prefill(self.place, request_id, prompt_token_ids,
                                                                         cache_salt, replica, lora_request)
            request = SubmitRequest(request_id, prompt_token_ids, params, self.gateway_id, cache_salt, resumed,
                                    kv_transfer_params, lora_request)
            while True:
                tried.add(replica)
                self._subscriber.expect(request_id, replica.instance_id)
                submit = self._batcher.submit((replica.stub, replica.instance_id), request)
                try:
                    await asyncio.shield(submit)
                    break
                except SubmitRefused as exc:
                    # A replica that began draining (or lost its worker) since the last poll
                    # refuses as UNAVAILABLE, and a successor on a dead one's address as
                    # FAILED_PRECONDITION: another one may take the request.
                    other = (self._placement.reroute(replica, placed, exc.code, pool) if exc.code in _TRY_ANOTHER
                             else None)
                    if other is None:
                        raise _submit_error(exc, replica.member) from exc
                    replica = other
            async for delta in stream.deltas():
                if prefill_leg is not None and delta.first_token_times is not None:
                    delta = with_remote_times(delta, await prefill_leg.finished())
                yield delta
        finally:
            if prefill_leg is not None:
                prefill_leg.cancel()
            self._subscriber.discard(request_id)
            self._placement.release(placed)
            # Whatever did not finish may still run there (the consumer left, the stream
            # broke, Submit was cancelled midway); aborting an unknown id is a no-op.
            if stream.unfinished and submit is not None:
                submit.add_done_callback(lambda done: done.exception() or self._send_abort(replica, request_id))

    async def abort(self, request_id: str) -> None:
        """A request id aborts the request and its children; a child id, that child only."""
        with self._lock:
            replica = self._placed.get(request_id)
        if replica is not None:
            self._send_abort(replica, request_id)

    def _send_abort(self, replica: Replica, request_id: str) -> None:
        """Fire and forget, from any thread."""
        try:
            call = replica.stub.Abort.future(AbortRequest(request_id), timeout=5.0)
        except ValueError:  # its channel is closed: the replica is gone, and the request with it
            return
        with self._lock:
            self._aborts.add(call)
        call.add_done_callback(self._aborted)

    def _aborted(self, call: grpc.Future) -> None:
        with self._lock:
            self._aborts.discard(call)
        if call.exception() is not None:
            logger.warning("abort failed: %s", call.exception())

    # -- replaying the token stream (the subscriber's ReplaySource) ----------------------

    def replay(self, instance_id: str, after_seq: int) -> list[StepOutputs] | None:
        replica = self._replicas.replica_of(instance_id)
        if replica is None:  # retired: its requests were failed then
            return None
        request = ReplayOutputsRequest(self.gateway_id, after_seq, instance_id)
        try:
            return list(replica.stub.ReplayOutputs(request, timeout=self._submit_timeout_s))
        except grpc.RpcError as exc:
            self._replicas.lost(replica, f"could not replay its token stream: {exc.code().name}: {exc.details()}")
            return None

    def instances(self) -> list[str]:
        with self._lock:
            return list({replica.instance_id for replica in self._placed.values()})


def _submit_error(exc: SubmitRefused, scheduler: Member) -> Exception:
    if exc.code is grpc.StatusCode.INVALID_ARGUMENT:
        return invalid_argument(exc.details)
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # the last replica that could take it is full too
        return EngineOverloaded(f"every scheduler's queue is full ({exc.details}); try again shortly")
    return EngineUnavailable(f"scheduler at {scheduler.address}: {exc.code.name}: {exc.details}")
