"""A worker: weights, the KV cache and per-request state on one device; runs step plans."""
from __future__ import annotations

import torch

from services.config import EngineConfig
from services.messages import StepPlan, StepResult, WorkerDescription
from services.model_source import resolve_model
from worker_svc.attention.torch_backend import TorchAttentionBackend
from worker_svc.batch import RequestState, prepare_inputs
from worker_svc.kv_cache import allocate_kv_cache, bytes_per_block, check_fits_one_request, num_blocks_for_budget
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.sampler import SamplingBatch, gather_logprobs, sample
from worker_svc.weights import load_weights


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model_config, weights = load_weights(resolve_model(config.model), self.dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.attention_backend = TorchAttentionBackend()
        with torch.device("meta"):
            self.model = LlamaForCausalLM(self.model_config, self.attention_backend, self.max_model_len, self.device)
        self.model.load_weights({name: t.to(self.device) for name, t in weights.items()})
        self.model.eval()
        self.block_size = config.block_size
        self.num_blocks = self._size_kv_cache()
        self.kv_caches = allocate_kv_cache(self.model_config, self.num_blocks, self.block_size, self.dtype, self.device)
        self.requests: dict[str, RequestState] = {}

    def _size_kv_cache(self) -> int:
        block_bytes = bytes_per_block(self.model_config, self.block_size, self.dtype)
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
            num_blocks = budget // block_bytes
        else:
            num_blocks = num_blocks_for_budget(
                self.model_config, self.block_size, self.dtype, self.config.kv_cache_memory
            )
        check_fits_one_request(num_blocks, self.block_size, self.max_model_len, block_bytes)
        return num_blocks

    def describe(self) -> WorkerDescription:
        return WorkerDescription(
            num_kv_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_deltas(plan)
        result = StepResult(plan.step_id)
        if not plan.num_scheduled_tokens:
            return result
        inputs = prepare_inputs(plan, self.requests, self.block_size, self.device)
        metadata = self.attention_backend.build_metadata(inputs.layout)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata)
        if inputs.sample_request_ids:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            states = [self.requests[r] for r in inputs.sample_request_ids]
            batch = SamplingBatch.from_params(
                [s.sampling_params for s in states], [s.generator for s in states], self.device
            )
            sampled = sample(logits, batch)
            tokens = sampled.tolist()
            for request_id, state, token in zip(inputs.sample_request_ids, states, tokens):
                state.token_ids.append(token)
                result.sampled_token_ids[request_id] = [token]
            wanted = [s.sampling_params.logprobs for s in states]
            if any(n is not None for n in wanted):
                for row, entry in gather_logprobs(logits, sampled, wanted).items():
                    result.logprobs[inputs.sample_request_ids[row]] = [entry]
        for request_id, count in plan.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += count
        return result

    def _apply_deltas(self, plan: StepPlan) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(new.sampling_params.seed)
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.sampling_params, generator
            )
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            if state.num_computed_tokens != cached.num_computed_tokens:
                raise RuntimeError(
                    f"worker out of sync on {cached.request_id}: has {state.num_computed_tokens} "
                    f"computed tokens, the scheduler says {cached.num_computed_tokens}"
                )
            state.block_ids.extend(cached.new_block_ids)
