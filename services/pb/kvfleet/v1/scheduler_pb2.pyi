from services.pb.kvfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt", "gateway_id", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    cache_salt: str
    gateway_id: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., gateway_id: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("requests", "scheduler_instance_id")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    scheduler_instance_id: str
    def __init__(self, requests: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ..., scheduler_instance_id: _Optional[str] = ...) -> None: ...

class SubmitResult(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SubmitBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SubmitResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SubmitResult, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("scheduler_instance_id",)
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    scheduler_instance_id: str
    def __init__(self, scheduler_instance_id: _Optional[str] = ...) -> None: ...

class StreamOutputsRequest(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("deltas", "scheduler_instance_id", "seq", "announce")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDelta]
    scheduler_instance_id: str
    seq: int
    announce: bool
    def __init__(self, deltas: _Optional[_Iterable[_Union[_common_pb2.TokenDelta, _Mapping]]] = ..., scheduler_instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., announce: _Optional[bool] = ...) -> None: ...

class ReplayOutputsRequest(_message.Message):
    __slots__ = ("gateway_id", "after_seq", "scheduler_instance_id")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    after_seq: int
    scheduler_instance_id: str
    def __init__(self, gateway_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., scheduler_instance_id: _Optional[str] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("scheduler_instance_id", "seq", "cleared", "removed", "stored")
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    scheduler_instance_id: str
    seq: int
    cleared: bool
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, scheduler_instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., cleared: _Optional[bool] = ..., removed: _Optional[_Iterable[bytes]] = ..., stored: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvSnapshotRequest(_message.Message):
    __slots__ = ("scheduler_instance_id",)
    SCHEDULER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    scheduler_instance_id: str
    def __init__(self, scheduler_instance_id: _Optional[str] = ...) -> None: ...

class KvSnapshotResponse(_message.Message):
    __slots__ = ("seq", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
