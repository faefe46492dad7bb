from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias", "allowed_token_ids", "bad_words", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens", "bad_words_token_ids", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    n: int
    best_of: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: TokenIds
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    truncate_prompt_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    structured_outputs: StructuredOutputs
    def __init__(self, n: _Optional[int] = ..., best_of: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., bad_words: _Optional[_Iterable[str]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("kind", "spec", "disable_any_whitespace", "field_name", "reasoning_end_token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    FIELD_NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    disable_any_whitespace: bool
    field_name: str
    reasoning_end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., field_name: _Optional[str] = ..., reasoning_end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, positions: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finish_reason", "stop_token_id", "stop_string", "logprobs", "prompt_logprobs", "error", "first_token_times", "lost", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIMES_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    logprobs: Logprobs
    prompt_logprobs: Logprobs
    error: str
    first_token_times: FirstTokenTimes
    lost: bool
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., error: _Optional[str] = ..., first_token_times: _Optional[_Union[FirstTokenTimes, _Mapping]] = ..., lost: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class FirstTokenTimes(_message.Message):
    __slots__ = ("queued_s", "prefill_s")
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    prefill_s: float
    def __init__(self, queued_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "num_preemptions", "num_kv_blocks", "prefix_cache_queries", "prefix_cache_hits", "iteration_tokens", "cache_config")
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    iteration_tokens: HistogramCounts
    cache_config: CacheConfigInfo
    def __init__(self, num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., iteration_tokens: _Optional[_Union[HistogramCounts, _Mapping]] = ..., cache_config: _Optional[_Union[CacheConfigInfo, _Mapping]] = ...) -> None: ...

class HistogramCounts(_message.Message):
    __slots__ = ("counts", "sum")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...

class CacheConfigInfo(_message.Message):
    __slots__ = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching", "gpu_memory_utilization", "swap_space", "num_gpu_blocks_override", "cache_dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    SWAP_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    swap_space: float
    num_gpu_blocks_override: int
    cache_dtype: str
    def __init__(self, block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., gpu_memory_utilization: _Optional[float] = ..., swap_space: _Optional[float] = ..., num_gpu_blocks_override: _Optional[int] = ..., cache_dtype: _Optional[str] = ...) -> None: ...
