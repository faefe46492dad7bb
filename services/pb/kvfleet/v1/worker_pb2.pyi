from services.pb.kvfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeWorkerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompileGrammarResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("num_kv_blocks", "num_host_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "instance_id", "max_plans_in_flight")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_PLANS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    max_plans_in_flight: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., max_plans_in_flight: _Optional[int] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling_params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_computed_tokens", "new_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("request_id", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "num_scheduled_tokens", "finished_request_ids", "blocks_to_copy", "blocks_to_swap_out", "blocks_to_swap_in", "worker_instance_id", "scheduler_instance_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    WORKER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequestData]
    num_scheduled_tokens: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    worker_instance_id: str
    scheduler_instance_id: str
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequestData, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., worker_instance_id: _Optional[str] = ..., scheduler_instance_id: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "logprobs", "prompt_logprobs")
    class SampledTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TokenIds
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ...) -> None: ...
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Logprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Logprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: _containers.MessageMap[str, _common_pb2.TokenIds]
    logprobs: _containers.MessageMap[str, _common_pb2.Logprobs]
    prompt_logprobs: _containers.MessageMap[str, _common_pb2.Logprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[_Mapping[str, _common_pb2.TokenIds]] = ..., logprobs: _Optional[_Mapping[str, _common_pb2.Logprobs]] = ..., prompt_logprobs: _Optional[_Mapping[str, _common_pb2.Logprobs]] = ...) -> None: ...
