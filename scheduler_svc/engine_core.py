"""The engine core: a scheduler driving a worker group through typed step messages.

Whoever builds it hands it the worker: an in-process Worker (the SDK, embedded
serving) or a RemoteWorker over gRPC (the scheduler role). The same StepPlan /
StepResult travel either way; nothing else changes.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import msgspec

from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.kv_handoff import KvHandoff
from scheduler_svc.plans_in_flight import PlansInFlight
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from services.config import EngineConfig
from services.engine_client import EngineUnavailable
from services.invalid_parameter import InvalidParameter
from services.kv_block_files import file_tiers
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import (
    CacheConfigInfo,
    EngineStats,
    LoraStats,
    StepPlan,
    StepResult,
    TokenDelta,
    WorkerDescription,
)
from services.parallel_sampling import child_params, child_request_id, num_children
from services.sampling_params import SamplingParams
from services.structured_outputs import StructuredOutputsParams


class StepFailed(RuntimeError):
    """A step's execution failed; its requests have been aborted."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids


class WorkerLost(RuntimeError):
    """The worker group's state is gone: it died, or it restarted with an empty KV cache."""


class WorkerHandle(Protocol):
    """What the scheduler needs of a worker group: the in-process Worker, or a gRPC client of one."""

    def describe(self) -> WorkerDescription: ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Raises WorkerLost when the worker holds none of the state the plan builds on."""

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """execute() without waiting for the result, for a group that works on several
        plans at once (its pipeline stages); plans run in the order submitted."""

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compiles a constraint into the worker's grammar cache; InvalidParameter when invalid."""

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks an adapter into the worker's host cache; ValueError naming what is wrong."""

    def remove_lora(self, lora_int_id: int) -> bool: ...


class EngineCore:
    def __init__(self, config: EngineConfig, worker: WorkerHandle, worker_address: str | None = None) -> None:
        """`worker_address`: where the worker serves gRPC, which a prefill/decode handoff
        needs (docs/disaggregation.md): other replicas' workers fetch its blocks there."""
        self.config = config
        self.worker = worker
        self.instance_id = uuid.uuid4().hex  # its worker drops what a previous instance left there
        self.description = described = worker.describe()
        # Async scheduling: step N+1 is planned and handed over while step N runs. A worker
        # group's followers would need the leader's sampled tokens: not yet.
        self.runs_ahead = config.async_scheduling and described.max_plans_in_flight == 1 and (
            config.tensor_parallel_size * config.pipeline_parallel_size == 1)
        self._depth = 2 if self.runs_ahead else described.max_plans_in_flight
        self._worker_lost = False
        self._streams_waiting_since: float | None = None  # the last step's end, while requests run
        self._in_flight = PlansInFlight(timed=self.runs_ahead)
        self.max_model_len = described.max_model_len
        self.eos_token_ids = described.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=described.max_model_len,
                block_size=described.block_size,
                num_blocks=described.num_kv_blocks,
                vocab_size=described.vocab_size,
                enable_prefix_caching=config.enable_prefix_caching and not described.bidirectional,
                enable_chunked_prefill=config.enable_chunked_prefill and not described.bidirectional,
                preemption_mode=config.preemption_mode,
                num_host_blocks=described.num_host_blocks,
                async_scheduling=self.runs_ahead,
                speculative=config.speculative,
                pooler=described.pooler,
                generates=described.generates,
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            KvConnector(described.num_offload_blocks, file_tiers(config, described.kv_layout_key))
            if config.has_kv_connector else None,
            self._handoff(config, worker_address, described.kv_block_bytes),
        )
        # The adapters add_lora loaded (runtime loads), by id: a replica lists them again in a
        # registry that lost them (scheduler_svc/lora_announce.py).
        self.loaded_loras: dict[int, LoRARequest] = {}
        # vllm:lora_requests_info's names, and the queues' versions they were taken at (_lora_stats).
        self._lora_versions: tuple[int, int] | None = None
        self._lora: LoraStats | None = None
        # Built once: every stats() shares it.
        self.cache_config = CacheConfigInfo(
            block_size=described.block_size,
            num_gpu_blocks=described.num_kv_blocks,
            num_cpu_blocks=described.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            swap_space=config.swap_space,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            cache_dtype=config.kv_cache_dtype,
        )

    def _handoff(self, config: EngineConfig, worker_address: str | None, block_bytes: int) -> KvHandoff | None:
        if config.kv_transfer is None:
            return None
        if worker_address is None:
            raise EngineUnavailable("--kv-transfer-config needs the cluster's roles (kvfleet worker and scheduler, "
                                    "or cluster up): another replica's worker fetches the KV from this one's")
        return KvHandoff(config.kv_transfer, self.instance_id, worker_address, block_bytes)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        output_token_ids: Sequence[int] = (),
        kv_transfer_params: KvTransferParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; with n > 1 (or best_of) as child requests named by
        `child_request_id`, which share the prompt's KV. `output_token_ids` resumes a
        request that generated them elsewhere (SubmitRequest.output_token_ids)."""
        if self._worker_lost:
            self._reconnect()
        count = num_children(params)
        if output_token_ids and count > 1:
            raise InvalidParameter("output_token_ids", "a request with n or best_of > 1 cannot be resumed")
        if kv_transfer_params is not None and (count > 1 or output_token_ids):
            raise InvalidParameter("kv_transfer_params", "a request with n or best_of > 1, or resumed, cannot hand "
                                   "its KV over")
        if lora_request is not None and not self.config.enable_lora:
            raise InvalidParameter("model", f"adapter {lora_request.lora_name!r}: LoRA is not enabled "
                                   "(start with --enable-lora)")
        if count == 1:
            request = self._request(request_id, prompt_token_ids, params, cache_salt, lora_request)
            request.output_token_ids = list(output_token_ids)
            request.kv_transfer_params = kv_transfer_params
            self.scheduler.add_request(request)
            return
        leader, *followers = (
            self._request(child_request_id(request_id, i), prompt_token_ids, child_params(params, i), cache_salt,
                          lora_request)
            for i in range(count)
        )
        self.scheduler.add_request(leader, followers)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Has the worker compile the request's output constraint, if it has one. Called
        by whoever accepts the request, on its own thread, before add_request: never on
        the step loop, which a compilation would stall. Raises InvalidParameter, naming
        the field that carried the constraint, when the compiler refuses it."""
        if params.structured_outputs is not None:
            self.worker.compile_grammar(params.structured_outputs)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Has the worker read and check the adapter, as compile_grammar: on the caller's
        thread, before the requests that name it. Raises ValueError naming what is wrong."""
        self.worker.add_lora(lora_request)
        self.loaded_loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        self.loaded_loras.pop(lora_int_id, None)
        return self.worker.remove_lora(lora_int_id)

    def _request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, cache_salt=cache_salt,
                       lora_request=lora_request)

    def abort_request(self, request_id: str) -> TokenDelta | None:
        return self.scheduler.abort_request(request_id)

    @property
    def has_work(self) -> bool:
        # A lost worker is tried again by the next add_request, not by spinning on steps.
        return (self.scheduler.has_work or bool(self._in_flight)) and not self._worker_lost

    def step(self) -> list[TokenDelta]:
        """One plan's worth of progress. With a pipelined group (description.max_plans_in_flight
        > 1) it first fills the pipeline with plans of the requests not already in flight
        (vLLM's virtual engines: the stages each work on another plan), then waits for the
        oldest plan's result. With async scheduling it keeps the next plan handed over
        while the worker runs the current one."""
        depth = self._depth
        if depth == 1:
            started = time.perf_counter()
            plan = self._plan()
            deltas = self._finish(plan, lambda: self._execute(plan))
            # What the streams waited: since the last step's outputs while they ran (the
            # caller's work between steps counts, taking requests in), else this step.
            ended = time.perf_counter()
            self.scheduler.record_turn_time(plan, ended - (self._streams_waiting_since or started))
            self._streams_waiting_since = ended if self.scheduler.running else None
            return deltas
        while (len(self._in_flight) < depth and not (self.runs_ahead and self._in_flight and
                                                      not self.scheduler.plans_ahead)
               and (self.scheduler.num_schedulable or self.scheduler.has_drops)):
            # A pipeline gives each plan it has room for an even share; a plan ahead takes all.
            share = None if self.runs_ahead else -(-self.scheduler.num_schedulable // (depth - len(self._in_flight)))
            plan = self._plan(share)
            try:
                self._in_flight.add(plan, self.worker.submit(plan))
            except Exception as exc:  # never handed over: fails as an executed plan would
                failed: Future[StepResult] = Future()
                failed.set_exception(exc)
                return self._finish(plan, failed.result)
            if not plan.num_scheduled_tokens:
                break  # nothing could be scheduled: wait for a result before trying again
        if not self._in_flight:
            return []
        entry = self._in_flight.take()

        def result_of() -> StepResult:
            result = entry.result.result()
            if (seconds := self._in_flight.worker_seconds(entry)) is not None:
                self.scheduler.record_step_time(entry.plan, seconds)
            return result

        return self._finish(entry.plan, result_of)

    def _execute(self, plan: StepPlan) -> StepResult:
        """Runs one plan on the worker, timed: speculative decoding prices a step's rows by
        it (scheduler_svc/spec_step_cost.py); a whole turn's time caps pooling tokens beside
        generation (scheduler_svc/pooling_budget.py). Plans in flight together are not timed
        here: async scheduling's are priced as PlansInFlight times them (the worker runs them
        one after another), a pipeline's keep the first prices; both keep the first cap."""
        started = time.perf_counter()
        result = self.worker.execute(plan)
        self.scheduler.record_step_time(plan, time.perf_counter() - started)
        return result

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._in_flight)

    def _plan(self, max_requests: int | None = None) -> StepPlan:
        plan = self.scheduler.schedule(max_requests)
        plan.worker_instance_id = self.description.instance_id
        plan.scheduler_instance_id = self.instance_id
        return plan

    def _finish(self, plan: StepPlan, result_of: Callable[[], StepResult]) -> list[TokenDelta]:
        try:
            result = result_of()
        except WorkerLost as exc:
            self._worker_lost = True
            self._in_flight.clear()  # their requests end with the rest
            raise StepFailed(self.scheduler.forget_worker(), exc) from exc
        except Exception as exc:
            # Only the requests in this step are in doubt: end them (freeing their
            # blocks) and let the caller report them; the rest keep running.
            failed = self.scheduler.requests_in(plan)
            for request_id in failed:
                self.scheduler.abort_request(request_id)
            self.scheduler.resend_drops(plan.finished_request_ids)
            raise StepFailed(failed, exc) from exc
        return self.scheduler.update(plan, result)

    def check_worker(self) -> list[str] | None:
        """After the worker link came back: a worker that restarted meanwhile holds none of
        the KV the cached prefixes and live requests built on, so those are forgotten
        (the ids of the requests that end are returned) before any plan reaches it.
        None: the worker did not answer (its client's channel may still be reconnecting)."""
        try:
            described = self.worker.describe()
        except Exception:
            return None
        if described.instance_id == self.description.instance_id:
            return []
        ended = self.scheduler.forget_worker()
        self._worker_lost = True
        try:  # what it just described, not a second call: that one could miss it while its channel flaps
            self._take_up(described)
        except EngineUnavailable:  # another shape: requests stay refused, saying why
            pass
        return ended

    def _reconnect(self) -> None:
        """Takes up a worker that came back after a loss; until then requests are refused."""
        try:
            described = self.worker.describe()
        except Exception as exc:
            raise EngineUnavailable(f"the worker is unavailable: {exc}") from exc
        self._take_up(described)

    def _take_up(self, described: WorkerDescription) -> None:
        """The worker `described`, if it has the shape the scheduler's block pool was sized for."""
        if msgspec.structs.replace(described, instance_id="") != msgspec.structs.replace(self.description, instance_id=""):
            raise EngineUnavailable(
                f"the worker came back with another shape ({described}, was {self.description}); "
                "restart the scheduler to take it up"
            )
        self.description = described
        self._worker_lost = False

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.block_pool.usage,
            num_preemptions=scheduler.num_preemptions,
            num_kv_blocks=scheduler.block_pool.num_blocks,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            iteration_tokens=scheduler.iteration_tokens.snapshot(),
            cache_config=self.cache_config,
            spec_decoding=scheduler.spec_decoding.stats() if self.config.speculative is not None else None,
            prompt_tokens_by_source=dict(scheduler.prompt_tokens_by_source),
            kv_transfer=scheduler.handoff.stats() if scheduler.handoff is not None else None,
            lora=self._lora_stats() if self.config.enable_lora else None,
            **self._tier_stats(),
        )

    def _lora_stats(self) -> LoraStats:
        """Recomputed only when the queues changed: stats() runs every engine iteration."""
        def names(requests: Iterable[Request]) -> list[str]:
            return list(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))

        versions = (self.scheduler.running.version, self.scheduler.waiting.version)
        if self._lora_versions != versions:
            self._lora_versions = versions
            self._lora = LoraStats(self.config.max_loras, names(self.scheduler.running), names(self.scheduler.waiting))
        return self._lora

    def _tier_stats(self) -> dict:
        connector = self.scheduler.connector
        if connector is None:
            return {}
        return {"external_prefix_cache_queries": connector.queries, "external_prefix_cache_hits": connector.hits,
                "kv_tiers": connector.stats()}
