"""The offline SDK: `LLM(...).generate(...)` and `.chat(...)`, shaped like vLLM's: a
scheduler and an in-process worker stepped by the caller's thread."""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import msgspec
from tqdm.auto import tqdm

from kvfleet.llm_pooling import PoolingMethods
from kvfleet.prompts import Prompt, as_prompt_list
from scheduler_svc.engine_core import EngineCore
from services.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from services.config import EngineConfig
from services.lora_request import LoRARequest
from services.outputs import RequestOutput
from services.prompt import fit_prompt
from services.sampling_params import SamplingParams
from services.telemetry import LOG_FORMAT
from tokenizer_svc.text_output import OutputProcessor
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.kernels.cpu.threads import configure_torch_threads
from worker_svc.runtime.preflight import check_device, check_model
from worker_svc.worker_group import start_worker

logger = logging.getLogger(__name__)
# Every package whose lines the SDK shows: load progress, the start-up summary, notes.
_LOGGING_PACKAGES = ("kvfleet", "services", "worker_svc", "scheduler_svc", "tokenizer_svc")

_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM(PoolingMethods):
    """Takes EngineConfig's fields, vLLM's names (`dtype`, `max_model_len`, `tensor_parallel_size`, ...)."""

    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        unknown = set(engine_args) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        show_log_lines()
        configure_torch_threads()
        self.config = EngineConfig(model=model, **engine_args)
        for note in self.config.ignored():
            logger.info("%s", note)
        check_model(self.config)  # before the tokenizer loads, so a bad setting fails at once
        check_device(self.config)
        self.tokenizer = Tokenizer.for_engine(self.config)
        self.engine = EngineCore(self.config, start_worker(self.config))
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (see --generation-config)."""
        return SamplingParams(**self.tokenizer.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        prompt_list = as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        for lora in dict.fromkeys(lora for lora in lora_list if lora is not None):
            self.engine.add_lora(lora)  # read and checked before any request is queued
        processor = OutputProcessor(self.tokenizer)
        order = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list):
                if params.bad_words:
                    banned = self.tokenizer.bad_words_token_ids(params.bad_words)
                    params = msgspec.structs.replace(params, bad_words_token_ids=banned)
                text, token_ids = self._tokenize(prompt)
                token_ids = fit_prompt(token_ids, params, self.engine.max_model_len)
                request_id = str(next(self._request_ids))
                cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self.engine.compile_grammar(params)
                self.engine.add_request(request_id, token_ids, params, cache_salt=cache_salt, lora_request=lora)
                processor.add_request(request_id, text, token_ids, params)
                order.append(request_id)
        except Exception:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return self._run(processor, order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        def next_tokens(token_lists: list[list[int]], round_params: SamplingParams) -> list[dict[int, float]]:
            outputs = self.generate(token_lists, round_params, use_tqdm=False)
            return [output.outputs[0].logprobs[0] for output in outputs]

        eos = self.engine.eos_token_ids
        outputs = [beam_search(self._tokenize(p)[1], params, eos, next_tokens) for p in as_prompt_list(prompts)]
        for output in outputs:
            for sequence in output.sequences:
                # As vLLM's LLM.beam_search: the text of the whole sequence, prompt included.
                sequence.text = self.tokenizer.decode(sequence.tokens)
        return outputs

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def _run(self, processor: OutputProcessor, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm or len(order) < 2) as bar:
            while self.engine.has_work:
                for output in processor.process(self.engine.step(), self.engine.abort_request):
                    done[output.request_id] = output
                    bar.update(1)
        return [done[request_id] for request_id in order]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return list(params)


def _as_lora_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"got {len(lora)} LoRA requests for {count} prompts")
    return list(lora)


def show_log_lines() -> None:
    """As vLLM does for its own loggers: when the application has configured no logging,
    kvfleet's INFO lines go to stderr, so a model load is not a silent minute.
    KVFLEET_CONFIGURE_LOGGING=0 leaves logging alone."""
    if os.environ.get("KVFLEET_CONFIGURE_LOGGING", "1") == "0" or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in _LOGGING_PACKAGES:
        package = logging.getLogger(name)
        if not package.handlers:
            package.addHandler(handler)
            package.setLevel(logging.INFO)
            package.propagate = False
