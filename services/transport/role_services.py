"""The gRPC services of kvfleet's roles, as services/transport/rpc.py describes them:
each method's name, request and response types, and whether it streams. Servers
register their servicers and clients build their stubs from these, and nothing else."""
from __future__ import annotations

from services.kv_transfer_messages import KvBlock, KvFetchRequest
from services.lora_request import LoRARequest
from services.messages import Empty, EngineStats, StepPlan, StepResult, WorkerDescription
from services.scheduler_messages import (
    AbortRequest,
    KvSnapshotRequest,
    KvSnapshotResponse,
    RemoveLoraRequest,
    ReplayOutputsRequest,
    StatsRequest,
    StepOutputs,
    StreamOutputsRequest,
    SubmitBatchRequest,
    SubmitBatchResponse,
    SubmitRequest,
)
from services.structured_outputs import StructuredOutputsParams
from services.tokenizer_messages import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeBatchRequest,
    TokenizeBatchResponse,
    TokenizerChunk,
    TokenizerDescription,
    TokenizeRequest,
    TokenizeResponse,
)
from services.transport.rpc import Method, Service

SCHEDULER = Service("kvfleet.v1.Scheduler", (
    Method("Submit", SubmitRequest, Empty),
    # Submits that arrived together at a gateway: one call, one pass of the step loop.
    Method("SubmitBatch", SubmitBatchRequest, SubmitBatchResponse),
    Method("Abort", AbortRequest, Empty),
    Method("Stats", StatsRequest, EngineStats),
    # A gateway's token stream over gRPC: the first message (empty) says it is subscribed.
    Method("StreamOutputs", StreamOutputsRequest, StepOutputs, server_streaming=True),
    # What was published on NATS to a gateway that missed it.
    Method("ReplayOutputs", ReplayOutputsRequest, StepOutputs, server_streaming=True),
    Method("KvSnapshot", KvSnapshotRequest, KvSnapshotResponse),
    # A LoRA adapter read and checked by the replica's worker, before requests name it (docs/lora.md).
    Method("AddLora", LoRARequest, Empty),
    Method("RemoveLora", RemoveLoraRequest, Empty),
))

TOKENIZER = Service("kvfleet.v1.Tokenizer", (
    Method("Tokenize", TokenizeRequest, TokenizeResponse),
    Method("Detokenize", DetokenizeRequest, DetokenizeResponse),
    Method("TokenizeBatch", TokenizeBatchRequest, TokenizeBatchResponse),
    Method("Describe", Empty, TokenizerDescription),
    # The tokenizer's files, for gateways that detokenize locally.
    Method("GetTokenizer", Empty, TokenizerChunk, server_streaming=True),
))

WORKER = Service("kvfleet.v1.Worker", (
    Method("Describe", Empty, WorkerDescription),
    Method("ExecuteStep", StepPlan, StepResult),
    # Checked beside the steps, when a request arrives: a bad constraint is refused then.
    Method("CompileGrammar", StructuredOutputsParams, Empty),
    # Another replica's worker fetching the blocks this one holds for it (docs/disaggregation.md).
    Method("FetchKvBlocks", KvFetchRequest, KvBlock, server_streaming=True),
    Method("AddLora", LoRARequest, Empty),
    Method("RemoveLora", RemoveLoraRequest, Empty),
))
