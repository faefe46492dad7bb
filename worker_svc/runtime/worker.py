"""A worker: weights, the KV cache and per-request state on one device; runs step plans."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from services.config import EngineConfig
from services.lora_request import LoRARequest
from services.messages import StepPlan, StepResult, WorkerDescription
from services.structured_outputs import StructuredOutputsParams
from worker_svc.formats.eagle_head import read_eagle_head
from worker_svc.formats.sentence_transformers import pooling_defaults
from worker_svc.group.outcomes import Outcomes
from worker_svc.group.rank_group import RankGroup
from worker_svc.kernels.cpu.threads import step_threads
from worker_svc.model.bert import BertModel
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.weights import load_weights
from worker_svc.runtime import kernel_choice
from worker_svc.runtime.batch import InputBatch, RequestState
from worker_svc.runtime.cuda_graphs import forward_rows
from worker_svc.runtime.device import kv_cache_dtype, runs_q4_as_stored, torch_device, torch_dtype
from worker_svc.runtime.draft_model import DraftModel
from worker_svc.runtime.eagle_drafter import EagleDrafter
from worker_svc.runtime.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks
from worker_svc.runtime.kv_sizing import size_kv_cache
from worker_svc.runtime.kv_tiers import build_kv_transfer
from worker_svc.runtime.lora_manager import LoraManager
from worker_svc.runtime.plan_check import check_plan
from worker_svc.runtime.pooler import Pooler, resolve_pooler, token_type_ids
from worker_svc.runtime.preflight import check_model
from worker_svc.runtime.request_table import RequestTable
from worker_svc.runtime.sampling.step_outputs import StepOutputs
from worker_svc.runtime.worker_summary import summary_lines

if TYPE_CHECKING:
    from worker_svc.runtime.sampling.grammar import Grammars

logger = logging.getLogger(__name__)
# A scheduler with requests on a worker steps without pause: silent this long, it is gone.
SCHEDULER_GONE_S = 1.0


class Worker:
    def __init__(self, config: EngineConfig, group: RankGroup | None = None) -> None:
        """One rank of a worker group (worker_svc/worker_group.py), or a whole worker when `group` is None."""
        self.config = config
        self.group = group = group or RankGroup()
        self.instance_id = uuid.uuid4().hex
        self.group_lost: str | None = None  # why the group is down, once a rank died
        # Ends the other ranks of a group (worker_group.py): a leader whose step failed
        # midway may have left them waiting for it.
        self.end_group: Callable[[str], None] | None = None
        self._step_finished = True  # the step's collectives and hand-overs are all done
        self.closed = False
        # With async scheduling a plan is handed over while the one before it runs: a
        # thread of its own runs them in order, so the caller can plan the next meanwhile.
        self._step_thread = (ThreadPoolExecutor(1, thread_name_prefix="kvfleet-step")
                             if config.async_scheduling and not group.distributed else None)
        self._state_lock = threading.RLock()  # a step, or dropping a gone scheduler's requests: one at a time
        checked = check_model(config)  # before any loading: a bad flag fails in milliseconds
        self.source = checked.source
        self.max_model_len = checked.max_model_len
        self.device = torch_device(config, group.shard.rank)
        # An encoder (BERT, docs/pooling.md) only pools: no KV cache, no sampling, one rank.
        self.encoder = checked.config.is_encoder
        self.dtype = torch_dtype(config, self.device, self.encoder)
        self.lora: LoraManager | None = None  # --enable-lora's adapters (a decoder's, docs/lora.md)
        self.runs_q4 = not self.encoder and runs_q4_as_stored(config, self.device, checked.config)
        self.kv_dtype = kv_cache_dtype(config, self.dtype, self.runs_q4)
        torch.manual_seed(config.seed)  # what requests without a seed of their own draw from, as in vLLM
        started = time.perf_counter()
        if self.encoder:
            self.model_config = self.local_config = checked.config
            self.model = BertModel.load(self.source.path, checked.config, self.dtype, self.device)
            self.weights_bytes = sum(p.nbytes for p in self.model.parameters())
        else:
            self._load_decoder(config, group)
        self.load_seconds = time.perf_counter() - started
        # Whether its small steps' GEMMs take every thread (the AVX2 int16 and AVX-512 VNNI kernels:
        # threads.decode_threads).
        self.decode_gemms = any(getattr(module, "int16", None) is not None or getattr(module, "panels", None) is not None
                                for module in self.model.modules())
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # CompileGrammar calls come on several threads
        self.block_size = config.block_size
        self.batch = InputBatch(-(-self.max_model_len // self.block_size), self.block_size, self.device)
        self.table = RequestTable(self.batch, self.device, group.shard.samples, lambda: self.grammars,
                                  self.lora is not None)
        self.outputs = StepOutputs(self.model, self.model_config, self.batch, lambda: self.grammars)
        self.pooler_config = resolve_pooler(config, self.model_config,
                                            pooling_defaults(self.source.path) if self.encoder else {})
        final_norm = (lambda rows: rows) if self.encoder else (lambda rows: self.model.ops.norm(self.model.norm, rows))
        head = self.model.classify if self.model_config.labels else None
        self.pooler = Pooler(self.pooler_config, final_norm, head) if self.pooler_config is not None else None
        self.scheduler_instance_id = ""  # whose requests those are
        self.last_step_at = time.monotonic()  # when a step last began or ended
        self._stepping = False
        self.drafter = self._drafter(config)
        if self.encoder:
            self._no_kv_cache()
        else:
            self._allocate_kv_cache(config, group)
        # A pipeline's leader gets each plan's outcome later, from the last stage.
        self._outcomes = Outcomes(group) if group.shard.rank == 0 and not group.shard.samples else None
        for line in self.summary():
            logger.info("%s", line)

    def _load_decoder(self, config: EngineConfig, group: RankGroup) -> None:
        self.model_config, weights = load_weights(self.source, self.dtype, keep_quantized=self.runs_q4, shard=group.shard)
        self.local_config = group.shard.local_config(self.model_config)  # the heads and layers this rank computes
        self.weights_bytes = sum(tensor.nbytes for tensor in weights.values())
        self.attention_backend = kernel_choice.attention_backend(config, self.device, self.local_config, self.dtype)
        with torch.device("meta"):
            self.model = LlamaForCausalLM(self.model_config, self.attention_backend, self.max_model_len, self.device,
                                          group, kernel_choice.decoder_ops(config, self.device, self.dtype))
        self.model.load_weights({name: t.to(self.device) for name, t in weights.items()})
        self.model.eval()
        if config.enable_lora:
            self.lora = LoraManager(self.model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                    self.dtype, self.device, kernel_choice.uses_triton(config, self.device))
            self.model.attach_lora(self.lora.context)

    def _drafter(self, config: EngineConfig) -> DraftModel | EagleDrafter | None:
        """The model that drafts in this worker, for the speculative methods that have one."""
        method = config.speculative.method if config.speculative is not None else None
        if method == "draft_model":  # a whole model of its own: the rank that samples runs it, alone
            return DraftModel(config, self.device, self.dtype, self.max_model_len) if self.group.shard.samples else None
        if method in ("eagle", "eagle3"):
            head = read_eagle_head(config.speculative.model, method, self.model_config)
            # EAGLE-3 reads three layers' inputs: each stage keeps those it runs and passes them on.
            self.model.aux_hidden_state_layers = head.aux_layers
            if self.group.shard.samples:  # the head drafts on the rank that samples, alone
                return EagleDrafter(config, head, self.model, self.source, self.device, self.dtype,
                                    self.max_model_len)
        return None

    def _allocate_kv_cache(self, config: EngineConfig, group: RankGroup) -> None:
        # Block ids are the group's: every rank holds the same number, its own heads' and layers' share of each.
        self.num_blocks = group.minimum(size_kv_cache(self))
        self.kv_caches = allocate_kv_cache(self.local_config, self.num_blocks, self.block_size, self.kv_dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, self.block_size, self.kv_dtype)
        block_bytes = bytes_per_block(self.local_config, self.block_size, self.kv_dtype)
        swap_blocks = int(config.swap_space * 2**30) // block_bytes if config.preemption_mode == "swap" else 0
        self.num_host_blocks = group.minimum(swap_blocks)
        self.host_kv_caches = (
            allocate_kv_cache(self.local_config, self.num_host_blocks, self.block_size, self.kv_dtype,
                              torch.device("cpu"))
            if self.num_host_blocks
            else []
        )
        # A one-rank worker can always hand KV to another replica's and take it: it acts
        # only on what its scheduler's plans say (docs/disaggregation.md), so a worker
        # started without the scheduler's --kv-transfer-config still does its part.
        one_rank = config.tensor_parallel_size * config.pipeline_parallel_size == 1
        self.kv_transfer, self.num_offload_blocks, self.kv_layout_key = (
            build_kv_transfer(self) if config.has_kv_connector or one_rank else (None, 0, ""))
        # A replayed graph would not keep the layers' hidden states an EAGLE-3 head reads.
        self.graphs = kernel_choice.decode_graphs(config, self.device, group, self.model, self.attention_backend,
                                            self.kv_caches, self.batch) if not self.model.aux_hidden_state_layers else None
        if self.drafter is not None:
            self.drafter.capture_graphs(self.batch)

    def _no_kv_cache(self) -> None:
        """An encoder's blocks hold nothing: they only count, for the scheduler, the tokens of
        the requests in a step (each ends in the step that computes it), and of one plan ahead."""
        per_step = -(-self.config.max_num_batched_tokens // self.block_size) + self.config.max_num_seqs
        self.num_blocks, self.num_host_blocks, self.num_offload_blocks, self.kv_layout_key = 2 * per_step, 0, 0, ""
        self.kv_caches, self.host_kv_caches, self.kv_transfer, self.graphs = [], [], None, None

    def summary(self) -> list[str]:
        """The start-up summary's lines on the model and its KV cache."""
        return summary_lines(self)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests whose state this worker holds, by id (the table's)."""
        return self.table.requests

    @property
    def num_requests(self) -> int:
        """Requests whose state this worker holds: its scheduler has not yet told it they ended."""
        return len(self.requests)

    def describe(self) -> WorkerDescription:
        return WorkerDescription(
            num_kv_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            num_host_blocks=self.num_host_blocks,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            instance_id=self.instance_id,
            max_plans_in_flight=self.group.shard.pp_size,
            num_offload_blocks=self.num_offload_blocks,
            kv_layout_key=self.kv_layout_key,
            kv_block_bytes=bytes_per_block(self.local_config, self.block_size, self.kv_dtype),
            pooler=self.pooler_config,
            generates=self.config.runner != "pooling" and not self.encoder and not self.model_config.labels,
            bidirectional=self.encoder,
        )

    @property
    def grammars(self) -> Grammars:
        """Built when the first constraint arrives: xgrammar loads transformers, a second
        at start and at exit that a worker serving none should not pay."""
        with self._grammars_lock:
            if self._grammars is None:
                from worker_svc.runtime.sampling.grammar import Grammars

                self._grammars = Grammars(self.source, self.model_config.vocab_size, self.model_config.eos_token_ids)
            return self._grammars

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compiles a constraint into the grammar cache; raises InvalidParameter when it is invalid."""
        self.grammars.compile(params)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks an adapter into the host cache (LoraAdapterError names what is
        wrong), on the caller's thread: steps go on meanwhile."""
        self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.lora.list_loras() if self.lora is not None else []

    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        return self.lora

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs a plan of the scheduler's; a group's leader first hands it to every rank."""
        if self._outcomes is not None:
            return self.submit(plan).result()
        self._check(plan)
        self.group.send_plan(plan)
        return self._lead(plan)

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """Runs a plan as execute() does, but a pipeline's leader returns once its own
        stage is done with it: the later stages work on, and the next plan can follow."""
        if self._step_thread is not None:
            return self._step_thread.submit(self.execute, plan)
        if self._outcomes is None:
            return _settled(self.execute, plan)
        self._check(plan)
        self.group.send_plan(plan)
        try:
            self._lead(plan)
        except Exception as exc:
            return self._outcomes.expect(exc)
        return self._outcomes.expect(None)

    def _lead(self, plan: StepPlan) -> StepResult | None:
        """run_plan on a group's leader. A step that failed before its collectives and its
        hidden states' hand-over were done left the other ranks waiting for this one, for
        ever: the group ends (its ranks killed), so that this step and the later ones fail
        instead of hanging. A step that failed after them (sampling) fails alone."""
        try:
            return self.run_plan(plan)
        except Exception as exc:
            if not self._step_finished and self.group.distributed and self.end_group is not None:
                self.end_group(f"the leader's step failed midway: {exc!r}")
            raise

    def _check(self, plan: StepPlan) -> None:
        if self.group_lost is not None or self.closed:
            raise RuntimeError(f"the worker group is down: {self.group_lost or 'closed'}")
        check_plan(plan, self.instance_id, self.num_blocks, self.num_host_blocks, self.requests)

    def follow(self) -> None:
        """A follower rank's life: the leader's plans, until it broadcasts None (closing)."""
        while (plan := self.group.receive_plan()) is not None:
            self.run_plan(plan)

    def lose_group(self, reason: str) -> None:
        """A rank died: every later step fails with `reason`, and no plan will end the
        requests here (their state goes now)."""
        self.group_lost = reason
        with self._state_lock:
            self.table.clear()

    def close(self) -> None:
        """A group's leader tells its followers to exit, once; then it takes no more plans."""
        if self.closed or not self.group.distributed:
            return
        self.closed = True
        if self._outcomes is not None:
            self._outcomes.close()
        if self.group_lost is None:
            try:
                self.group.send_plan(None)
            except RuntimeError as exc:  # a rank died meanwhile: nothing left to tell
                logger.warning("closing the worker group: %s", exc)
        self.group.close()

    def run_plan(self, plan: StepPlan) -> StepResult | None:
        """Every rank runs every plan, in the same order: their collectives pair up. The
        sampling rank returns the outcome; the others None."""
        self.last_step_at = time.monotonic()
        self._step_finished = False
        with self._state_lock:
            if plan.scheduler_instance_id != self.scheduler_instance_id:
                self.drop_scheduler_state(f"scheduler instance {plan.scheduler_instance_id} took over")
                self.scheduler_instance_id = plan.scheduler_instance_id
            self._stepping = True
            try:
                return self._execute(plan)
            finally:
                self._stepping, self.last_step_at = False, time.monotonic()

    def scheduler_gone(self) -> bool:
        """No step runs and none came for SCHEDULER_GONE_S: a scheduler with requests here
        steps without pause, so it is gone (killed, or cut off)."""
        return not self._stepping and time.monotonic() - self.last_step_at > SCHEDULER_GONE_S

    def drop_scheduler_state(self, reason: str) -> None:
        """Forgets the requests of a scheduler that is gone: nobody will ever end them.
        Its KV holds end too: its successor plans those blocks anew, and a consumer still
        reading them would take another request's KV for its own."""
        with self._state_lock:
            if self.requests:
                logger.warning("dropping the state of %d requests: %s", len(self.requests), reason)
                self.table.clear()
            if self.kv_transfer is not None:
                self.kv_transfer.end_holds()

    def _execute(self, plan: StepPlan) -> StepResult | None:
        self._apply_deltas(plan)
        shard = self.group.shard
        with step_threads(self.device, sum(plan.num_scheduled_tokens.values()), self.decode_gemms):
            if plan.num_scheduled_tokens:
                outcome = self._compute(plan)
            else:
                if self.kv_transfer is not None:
                    self.kv_transfer.wait_for_loads(timeout_s=0.05)
                outcome = StepResult(plan.step_id)
        self._step_finished = True
        if not shard.samples:
            return None
        if self.kv_transfer is not None and isinstance(outcome, StepResult):
            # Taken only into a result that goes back: a failed step leaves them for the next.
            outcome.kv_loads_done = self.kv_transfer.take_loads_done()
            outcome.kv_tiers = self.kv_transfer.take_counts()
            outcome.kv_sent_done = self.kv_transfer.take_sent_done()
        if shard.rank != 0:
            self.group.send_outcome(RuntimeError(repr(outcome)) if isinstance(outcome, Exception) else outcome)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _compute(self, plan: StepPlan) -> StepResult | Exception | None:
        """The step's forward; on the sampling rank, its outcome (an exception when sampling failed)."""
        shard = self.group.shard
        inputs = self.batch.prepare(plan, self.requests)
        adapters = self.lora is not None and self.lora.step(
            [self.requests[request_id].lora_request for request_id in plan.num_scheduled_tokens],
            list(plan.num_scheduled_tokens.values()), inputs.token_requests) is not None
        if self.encoder:
            hidden = self.model(inputs.input_ids, inputs.positions, token_type_ids(plan, self.requests, self.device),
                                list(plan.num_scheduled_tokens.values()))
        else:  # a captured graph knows no adapter: a step with one runs eagerly
            hidden = forward_rows(self.graphs if not adapters else None, self.model, self.attention_backend,
                                  self.kv_caches, (inputs.input_ids,), inputs.positions, inputs.layout, inputs.row_starts)
        if self.drafter is not None:
            self.drafter.run(plan, inputs, hidden)
        outcome: StepResult | Exception | None = None
        if shard.is_last_stage:
            # Every collective first (the last stage's ranks gather logits together), so a
            # sampling error on the sampling rank cannot leave the others waiting in one.
            logits = self.model.compute_logits(hidden[inputs.sample_rows]) if inputs.sample_request_ids else None
            spec_logits = self.model.compute_logits(hidden[inputs.spec_rows]) if inputs.spec_requests else None
            prompt_logits = self.outputs.prompt_logits(plan, self.requests, inputs.row_starts, hidden)
            pooled = self.pooler.pool(plan, inputs.row_starts, hidden, self.requests) if self.pooler else {}
            if shard.samples:
                try:
                    outcome = self.outputs.sample(plan.step_id, inputs, self.requests, logits, prompt_logits,
                                                  spec_logits)
                    outcome.pooled = pooled
                except Exception as exc:  # this step fails on every rank alike
                    outcome = exc
        if self.drafter is not None and isinstance(outcome, StepResult):
            outcome.draft_token_ids = self.drafter.propose(outcome.sampled_token_ids, self.requests, self.batch,
                                                           set(plan.draft_probes))
        self.table.count_computed(plan, outcome.sampled_token_ids if isinstance(outcome, StepResult) else {})
        return outcome

    def _apply_deltas(self, plan: StepPlan) -> None:
        self.table.end(plan.finished_request_ids)
        copy_blocks(plan.blocks_to_copy, self.kv_caches, self.kv_caches)
        if self.drafter is not None:  # a forked request's partly filled block, in the draft's cache too
            copy_blocks(plan.blocks_to_copy, self.drafter.kv_caches, self.drafter.kv_caches)
        copy_blocks(plan.blocks_to_swap_out, self.kv_caches, self.host_kv_caches)
        copy_blocks(plan.blocks_to_swap_in, self.host_kv_caches, self.kv_caches)
        if self.kv_transfer is not None:
            self.kv_transfer.apply(plan)
        self.table.apply(plan)


def _settled(run: Callable[[StepPlan], StepResult], plan: StepPlan) -> Future[StepResult]:
    future: Future[StepResult] = Future()
    try:
        future.set_result(run(plan))
    except Exception as exc:
        future.set_exception(exc)
    return future
