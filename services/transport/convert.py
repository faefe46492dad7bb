"""Conversions between the in-process dataclasses (services/messages.py, SamplingParams)
and their protos (protos/kvfleet/v1). Each pair round-trips exactly; where a proto
cannot tell an empty list from None, the Python field treats both alike (see common.proto).
"""
from __future__ import annotations

import json
from collections.abc import Iterable

from services.histogram_counts import HistogramCounts
from services.messages import (
    CacheConfigInfo,
    CachedRequestData,
    EngineStats,
    FirstTokenTimes,
    NewRequestData,
    StepPlan,
    StepResult,
    TokenDelta,
    WorkerDescription,
)
from services.pb.kvfleet.v1 import common_pb2, tokenizer_pb2, worker_pb2
from services.sampling_params import InvalidParameter, SamplingParams
from services.structured_outputs import StructuredOutputsParams
from services.tokenizer_api import ChatPrompt

# SamplingParams' scalar fields; each is `optional` in the proto.
_SCALARS = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens",
)
# Scalars whose Python value may be None: unset in the proto means None, not the default.
_NULLABLE = ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


# -- SamplingParams -------------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        logit_bias=params.logit_bias or {},
        bad_words=params.bad_words or [],
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        bad_words_token_ids=[common_pb2.TokenIds(token_ids=ids) for ids in params.bad_words_token_ids],
    )
    for name in _SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.allowed_token_ids is not None:
        message.allowed_token_ids.token_ids.extend(params.allowed_token_ids)
        message.allowed_token_ids.SetInParent()  # an empty list is still "set" (and then rejected)
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return message


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidParameter, naming the field, on a bad value."""
    kwargs = {name: getattr(message, name) for name in _SCALARS if message.HasField(name)}
    kwargs.update({name: None for name in _NULLABLE if name not in kwargs})
    return SamplingParams(
        logit_bias=dict(message.logit_bias) or None,
        allowed_token_ids=list(message.allowed_token_ids.token_ids) if message.HasField("allowed_token_ids") else None,
        bad_words=list(message.bad_words) or None,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        bad_words_token_ids=[list(ids.token_ids) for ids in message.bad_words_token_ids],
        structured_outputs=structured_outputs_from_proto(message.structured_outputs)
        if message.HasField("structured_outputs") else None,
        **kwargs,
    )


def structured_outputs_to_proto(params: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    return common_pb2.StructuredOutputs(kind=params.kind, spec=params.spec, field_name=params.field_name,
                                        disable_any_whitespace=params.disable_any_whitespace,
                                        reasoning_end_token_ids=params.reasoning_end_token_ids)


def structured_outputs_from_proto(message: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Raises InvalidParameter on an unknown kind or a malformed choice list."""
    field_name = message.field_name or "structured_outputs"
    try:
        return StructuredOutputsParams.from_spec(message.kind, message.spec, message.disable_any_whitespace, field_name,
                                                 tuple(message.reasoning_end_token_ids))
    except InvalidParameter:
        raise
    except ValueError as exc:  # a choice list that is not JSON
        raise InvalidParameter(field_name, f"malformed {message.kind} constraint: {exc}") from exc


# -- logprobs ---------------------------------------------------------------------------


def logprobs_to_proto(positions: list[dict[int, float]]) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(
        positions=[common_pb2.TokenLogprobs(token_ids=list(p), logprobs=list(p.values())) for p in positions]
    )


def logprobs_from_proto(message: common_pb2.Logprobs) -> list[dict[int, float]]:
    return [dict(zip(p.token_ids, p.logprobs)) for p in message.positions]


# -- TokenDelta, EngineStats ----------------------------------------------------------


def delta_to_proto(delta: TokenDelta, error: str = "", lost: bool = False) -> common_pb2.TokenDelta:
    """`error` is the failure that ended the request, if one did; `lost`: a failure of
    what carried it (common.proto's TokenDelta.lost)."""
    message = common_pb2.TokenDelta(
        request_id=delta.request_id,
        new_token_ids=delta.new_token_ids,
        finish_reason=_FINISH_TO_PROTO[delta.finish_reason],
        error=error,
        lost=lost,
        num_cached_tokens=delta.num_cached_tokens,
    )
    if isinstance(delta.stop_reason, int):
        message.stop_token_id = delta.stop_reason
    elif isinstance(delta.stop_reason, str):
        message.stop_string = delta.stop_reason
    if delta.logprobs is not None:
        message.logprobs.CopyFrom(logprobs_to_proto(delta.logprobs))
    if delta.prompt_logprobs is not None:
        message.prompt_logprobs.CopyFrom(logprobs_to_proto(delta.prompt_logprobs))
    if delta.first_token_times is not None:
        message.first_token_times.CopyFrom(common_pb2.FirstTokenTimes(**vars(delta.first_token_times)))
    return message


def delta_from_proto(message: common_pb2.TokenDelta) -> TokenDelta:
    """The delta without `error`: a caller that surfaces failures reads `message.error`."""
    stop_field = message.WhichOneof("stop_reason")
    return TokenDelta(
        request_id=message.request_id,
        new_token_ids=list(message.new_token_ids),
        finish_reason=_FINISH_FROM_PROTO[message.finish_reason],
        stop_reason=getattr(message, stop_field) if stop_field else None,
        logprobs=logprobs_from_proto(message.logprobs) if message.HasField("logprobs") else None,
        prompt_logprobs=(
            logprobs_from_proto(message.prompt_logprobs) if message.HasField("prompt_logprobs") else None
        ),
        first_token_times=(
            FirstTokenTimes(message.first_token_times.queued_s, message.first_token_times.prefill_s)
            if message.HasField("first_token_times") else None
        ),
        num_cached_tokens=message.num_cached_tokens,
    )


def stats_to_proto(stats: EngineStats) -> common_pb2.EngineStats:
    fields = vars(stats).copy()
    histogram, cache_config = fields.pop("iteration_tokens"), fields.pop("cache_config")
    message = common_pb2.EngineStats(
        **fields, iteration_tokens=common_pb2.HistogramCounts(counts=histogram.counts, sum=histogram.sum)
    )
    if cache_config is not None:
        # An unset num_gpu_blocks_override is None: left out, it stays unset.
        message.cache_config.CopyFrom(
            common_pb2.CacheConfigInfo(**{k: v for k, v in vars(cache_config).items() if v is not None})
        )
    return message


def stats_from_proto(message: common_pb2.EngineStats) -> EngineStats:
    fields = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields if f.message_type is None}
    return EngineStats(
        **fields,
        iteration_tokens=HistogramCounts(tuple(message.iteration_tokens.counts), message.iteration_tokens.sum),
        cache_config=_cache_config_from_proto(message.cache_config) if message.HasField("cache_config") else None,
    )


def _cache_config_from_proto(message: common_pb2.CacheConfigInfo) -> CacheConfigInfo:
    fields = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}
    if not message.HasField("num_gpu_blocks_override"):
        fields["num_gpu_blocks_override"] = None
    return CacheConfigInfo(**fields)


# -- the worker's messages ------------------------------------------------------------


def description_to_proto(description: WorkerDescription) -> worker_pb2.WorkerDescription:
    return worker_pb2.WorkerDescription(**vars(description))


def description_from_proto(message: worker_pb2.WorkerDescription) -> WorkerDescription:
    return WorkerDescription(
        num_kv_blocks=message.num_kv_blocks,
        num_host_blocks=message.num_host_blocks,
        block_size=message.block_size,
        max_model_len=message.max_model_len,
        vocab_size=message.vocab_size,
        eos_token_ids=tuple(message.eos_token_ids),
        instance_id=message.instance_id,
        max_plans_in_flight=max(1, message.max_plans_in_flight),
    )


def _copies_to_proto(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src_block_id=src, dst_block_id=dst) for src, dst in pairs]


def _copies_from_proto(copies: Iterable[worker_pb2.BlockCopy]) -> list[tuple[int, int]]:
    return [(c.src_block_id, c.dst_block_id) for c in copies]


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            worker_pb2.NewRequestData(
                request_id=new.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=sampling_params_to_proto(new.sampling_params),
            )
            for new in plan.new_requests
        ],
        cached_requests=[
            worker_pb2.CachedRequestData(
                request_id=cached.request_id,
                new_block_ids=cached.new_block_ids,
                num_computed_tokens=cached.num_computed_tokens,
                new_token_ids=cached.new_token_ids,
            )
            for cached in plan.cached_requests
        ],
        num_scheduled_tokens=[
            worker_pb2.ScheduledTokens(request_id=request_id, num_tokens=count)
            for request_id, count in plan.num_scheduled_tokens.items()
        ],
        finished_request_ids=plan.finished_request_ids,
        blocks_to_copy=_copies_to_proto(plan.blocks_to_copy),
        blocks_to_swap_out=_copies_to_proto(plan.blocks_to_swap_out),
        blocks_to_swap_in=_copies_to_proto(plan.blocks_to_swap_in),
        worker_instance_id=plan.worker_instance_id,
        scheduler_instance_id=plan.scheduler_instance_id,
    )


def plan_from_proto(message: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=message.step_id,
        new_requests=[
            NewRequestData(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=sampling_params_from_proto(new.sampling_params),
            )
            for new in message.new_requests
        ],
        cached_requests=[
            CachedRequestData(
                request_id=cached.request_id,
                new_block_ids=list(cached.new_block_ids),
                num_computed_tokens=cached.num_computed_tokens,
                new_token_ids=list(cached.new_token_ids),
            )
            for cached in message.cached_requests
        ],
        num_scheduled_tokens={s.request_id: s.num_tokens for s in message.num_scheduled_tokens},
        finished_request_ids=list(message.finished_request_ids),
        blocks_to_copy=_copies_from_proto(message.blocks_to_copy),
        blocks_to_swap_out=_copies_from_proto(message.blocks_to_swap_out),
        blocks_to_swap_in=_copies_from_proto(message.blocks_to_swap_in),
        worker_instance_id=message.worker_instance_id,
        scheduler_instance_id=message.scheduler_instance_id,
    )


def result_to_proto(result: StepResult) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(
        step_id=result.step_id,
        sampled_token_ids={rid: common_pb2.TokenIds(token_ids=ids) for rid, ids in result.sampled_token_ids.items()},
        logprobs={rid: logprobs_to_proto(positions) for rid, positions in result.logprobs.items()},
        prompt_logprobs={rid: logprobs_to_proto(positions) for rid, positions in result.prompt_logprobs.items()},
    )


def result_from_proto(message: worker_pb2.StepResult) -> StepResult:
    return StepResult(
        step_id=message.step_id,
        sampled_token_ids={rid: list(ids.token_ids) for rid, ids in message.sampled_token_ids.items()},
        logprobs={rid: logprobs_from_proto(positions) for rid, positions in message.logprobs.items()},
        prompt_logprobs={rid: logprobs_from_proto(positions) for rid, positions in message.prompt_logprobs.items()},
    )


# -- chats --------------------------------------------------------------------------------


def chat_to_proto(chat: ChatPrompt) -> tokenizer_pb2.Chat:
    messages = []
    for entry in chat.messages:
        message = tokenizer_pb2.ChatMessage(role=entry["role"], content=entry.get("content") or "")
        if entry.get("name") is not None:
            message.name = entry["name"]
        if entry.get("tool_calls"):
            message.tool_calls_json = json.dumps(entry["tool_calls"])
        if entry.get("tool_call_id") is not None:
            message.tool_call_id = entry["tool_call_id"]
        messages.append(message)
    return tokenizer_pb2.Chat(messages=messages, add_generation_prompt=chat.add_generation_prompt,
                              tools_json=json.dumps(chat.tools) if chat.tools else "")


def chat_from_proto(chat: tokenizer_pb2.Chat, add_special_tokens: bool) -> ChatPrompt:
    """Raises InvalidParameter("messages" or "tools", ...) on a malformed chat."""
    if not chat.messages:
        raise InvalidParameter("messages", "must not be empty")
    messages = []
    for message in chat.messages:
        entry: dict = {"role": message.role, "content": message.content}
        if message.HasField("name"):
            entry["name"] = message.name
        if message.tool_calls_json:
            entry["tool_calls"] = _json_list(message.tool_calls_json, "messages")
        if message.HasField("tool_call_id"):
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return ChatPrompt(
        messages,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        add_special_tokens=add_special_tokens,
        tools=_json_list(chat.tools_json, "tools") if chat.tools_json else None,
    )


def _json_list(text: str, param: str) -> list:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidParameter(param, f"not valid JSON: {exc}") from exc
    if not isinstance(value, list):
        raise InvalidParameter(param, "must be a JSON list")
    return value

