"""vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`, PyPI smg-grpc-proto) on a
model replica's scheduler, for routers built for vLLM's gRPC server.

Each Generate is a front end of its own to the step loop: it subscribes to the
OutputHub under a gateway id of its own, submits, and turns the deltas into the
protocol's chunks and completions. A client that goes away aborts its request.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import common_pb2 as smg
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from scheduler_svc.engine_protocol.convert import Completion, prompt_from_request, sampling_params_from_engine_protocol
from scheduler_svc.engine_protocol.kv_events import KvEventStream
from scheduler_svc.engine_protocol.text import EngineText
from scheduler_svc.output_hub import OutputHub, Subscription
from scheduler_svc.step_loop import StepLoop
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.invalid_parameter import InvalidParameter
from services.parallel_sampling import num_children
from services.pooling_outputs import fit_pooling_prompt
from services.pooling_params import PoolingParams
from services.sampling_params import SamplingParams
from services.scheduler_messages import SubmitRequest
from services.tokenizer_archive import chunks
from services.transport.server import RoleServer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# Each Generate and SubscribeKvEvents holds a server thread for its lifetime.
MAX_WORKERS = 128
FLUSH_POLL_S = 0.05  # how often FlushCache looks again for an idle engine


def _index(request_id: str, engine_id: str) -> int:
    """Which of the n outputs a delta belongs to (services/parallel_sampling.py's ids)."""
    return 0 if engine_id == request_id else int(engine_id.rsplit("#", 1)[1])


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, loop: StepLoop, hub: OutputHub, kv_events: KvEventStream | None, text: EngineText,
                 worker_up: Callable[[], bool], model: str, served_model_name: str) -> None:
        self._loop = loop
        self._text = text
        self._hub = hub
        self._kv_events = kv_events
        self._worker_up = worker_up
        self._model = model
        self._served_model_name = served_model_name
        self._started = time.time()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        try:
            prompt = prompt_from_request(request, self._text.encode)
            params = sampling_params_from_engine_protocol(request.sampling_params)
            self._loop.core.compile_grammar(params)  # on this thread: never on the step loop
        except ValueError as exc:  # InvalidParameter's message starts with the field
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # the worker is away: the request may well succeed later
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker could not compile the constraint: {exc}")
        gateway_id, subscription = self._subscribe(context)
        finished = False
        try:
            self._submit(SubmitRequest(request.request_id, prompt, params, gateway_id), context)
            completions = [Completion(index, prompt, params, self._text.stop_strings(prompt, params))
                           for index in range(num_children(params))]
            live = len(completions)
            while live and (batch := subscription.next_batch()) is not None:
                for delta in batch:
                    if delta.error:
                        code = grpc.StatusCode.UNAVAILABLE if delta.lost else grpc.StatusCode.INTERNAL
                        context.abort(code, delta.error)
                    completion = completions[_index(request.request_id, delta.request_id)]
                    if completion.last is not None:  # in flight when a stop string ended it
                        continue
                    if completion.stop_strings is not None:
                        delta, still_running = completion.stop_strings.check(delta)
                        if still_running:
                            self._loop.abort(delta.request_id)
                    chunk = completion.add(delta)
                    if request.stream and (delta.new_token_ids or delta.prompt_logprobs is not None):
                        yield pb.GenerateResponse(chunk=chunk)
                    if delta.finish_reason:
                        live -= 1
                        completion.last = delta
                        if request.stream:
                            yield pb.GenerateResponse(complete=completion.complete(delta, with_outputs=False))
            finished = live == 0
            if finished and not request.stream:
                for completion in completions:
                    yield pb.GenerateResponse(complete=completion.complete(completion.last, with_outputs=True))
        finally:
            self._hub.unsubscribe(subscription)
            if not finished:  # the client went away, or the request failed: free its blocks now
                self._loop.abort(request.request_id)

    def _subscribe(self, context: grpc.ServicerContext) -> tuple[str, Subscription]:
        """A gateway id of this call's own and its subscription to the output hub, which the
        client's cancel or disconnect closes (waking a reader of it)."""
        gateway_id = f"vllm-engine-{uuid.uuid4().hex}"
        try:
            subscription = self._hub.subscribe(gateway_id)
        except EngineUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not context.add_callback(subscription.close):
            subscription.close()
        return gateway_id, subscription

    def _submit(self, request: SubmitRequest, context: grpc.ServicerContext) -> None:
        try:
            [accepted] = self._loop.submit([request])
            accepted.result()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        """One pooling request (docs/pooling.md): the model's pooled vector of the token ids."""
        core = self._loop.core
        if core.description.pooler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this model does not pool: serve it with --runner pooling "
                          "(or --convert embed)")
        try:
            if not request.request_id:
                raise InvalidParameter("request_id", "must not be empty")
            if not request.tokenized.input_ids:
                raise InvalidParameter("tokenized", "input_ids must not be empty")
            prompt = fit_pooling_prompt(list(request.tokenized.input_ids), None, core.max_model_len, "tokenized")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        gateway_id, subscription = self._subscribe(context)
        pooled = None
        try:
            self._submit(SubmitRequest(request.request_id, prompt, SamplingParams(pooling=PoolingParams()), gateway_id),
                         context)
            while pooled is None and (batch := subscription.next_batch()) is not None:
                for delta in batch:
                    if delta.error:
                        context.abort(grpc.StatusCode.UNAVAILABLE if delta.lost else grpc.StatusCode.INTERNAL,
                                      delta.error)
                    pooled = delta.pooled
        finally:
            self._hub.unsubscribe(subscription)
            if pooled is None:  # the client went away, or the request failed: free its blocks now
                self._loop.abort(request.request_id)
        if pooled is None:
            context.abort(grpc.StatusCode.CANCELLED, "the request ended without its vector")
        return pb.EmbedResponse(embedding=pooled, prompt_tokens=len(prompt), embedding_dim=len(pooled))

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self._loop.abort(request_id)
        return pb.AbortResponse()

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext) -> pb.HealthCheckResponse:
        if self._loop.draining:
            return pb.HealthCheckResponse(healthy=False, message="draining: no new requests")
        if not self._worker_up():
            return pb.HealthCheckResponse(healthy=False, message="the worker does not answer its health check")
        return pb.HealthCheckResponse(healthy=True, message="serving")

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        core = self._loop.core
        return pb.GetModelInfoResponse(
            model_path=self._model, served_model_name=self._served_model_name, tokenizer_path=self._model,
            is_generation=True, max_context_length=core.max_model_len, max_req_input_len=core.max_model_len,
            vocab_size=core.description.vocab_size, eos_token_ids=list(core.eos_token_ids))

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext
                      ) -> pb.GetServerInfoResponse:
        stats = self._loop.stats()
        config = self._loop.core.config
        return pb.GetServerInfoResponse(
            active_requests=stats.num_requests_running + stats.num_requests_waiting, is_paused=self._loop.draining,
            uptime_seconds=time.time() - self._started, server_type="kvfleet-grpc", data_parallel_size=1,
            block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype, model_dtype=config.dtype,
            max_num_seqs=config.max_num_seqs)

    def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.ServicerContext) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dp_rank: this replica has one rank, 0")
        stats = self._loop.stats()
        block_size = self._loop.core.config.block_size
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.num_requests_running, num_waiting_reqs=stats.num_requests_waiting,
            num_total_reqs=stats.num_requests_running + stats.num_requests_waiting,
            token_usage=stats.kv_cache_usage, max_running_requests=self._loop.core.config.max_num_seqs,
            num_used_tokens=round(stats.kv_cache_usage * stats.num_kv_blocks) * block_size,
            max_total_num_tokens=stats.num_kv_blocks * block_size,
            cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0)
        return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   dp_rank_count=1, loads=[load])

    def FlushCache(self, request: smg.FlushCacheRequest, context: grpc.ServicerContext) -> smg.FlushCacheResponse:
        """Empties the prefix cache once no request is in the engine, waiting up to `timeout_s` for that."""
        deadline = time.monotonic() + max(0.0, request.timeout_s)
        while not self._loop.flush_cache().result():
            if time.monotonic() >= deadline:
                return smg.FlushCacheResponse(success=False, message="requests are in flight: their blocks are in use")
            time.sleep(FLUSH_POLL_S)
        return smg.FlushCacheResponse(success=True, message="prefix cache emptied")

    def GetTokenizer(self, request: smg.GetTokenizerRequest, context: grpc.ServicerContext
                     ) -> Iterator[smg.GetTokenizerChunk]:
        for data, sha256 in chunks(self._text.archive):
            yield smg.GetTokenizerChunk(data=data, sha256=sha256)

    def SubscribeKvEvents(self, request: smg.SubscribeKvEventsRequest, context: grpc.ServicerContext
                          ) -> Iterator[smg.KvEventBatch]:
        if self._kv_events is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler publishes no KV events")
        subscriber = self._kv_events.subscribe(request.start_sequence_number)
        if subscriber is None:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"start_sequence_number: batch {request.start_sequence_number} is no longer held")
        if not context.add_callback(lambda: self._kv_events.unsubscribe(subscriber)):
            self._kv_events.unsubscribe(subscriber)
        # Headers now, not with the first batch (which may be long in coming): smg takes a
        # subscription that answers nothing within 2 s for an unreachable worker.
        context.send_initial_metadata(())
        try:
            while (batch := subscriber.get()) is not None:
                yield batch
        finally:
            self._kv_events.unsubscribe(subscriber)


def start_vllm_engine_server(servicer: VllmEngineServicer, address: str) -> RoleServer:
    """Serves `servicer` on `address`, with gRPC reflection for its service. It holds no
    requests of its own to drain: the scheduler's server drains the step loop."""

    def register(server: grpc.Server) -> None:
        pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)

    # A public door, not the cluster's plane: external routers (smg) hold no cluster token;
    # the port is opt-in, like the gateway's HTTP port, and NetworkPolicies/TLS guard it.
    server = RoleServer(address, SERVICE_NAME, register, max_workers=MAX_WORKERS, internal=False)
    server.start()
    return server
