"""Every message that crosses a process (services/transport/role_services.py's methods,
and what goes on NATS) round-trips exactly through the wire format, msgpack; decoding
validates, naming the field."""
from __future__ import annotations

import msgspec
import pytest

from services.histogram_counts import HistogramCounts
from services.invalid_parameter import InvalidParameter
from services.kv_transfer_messages import KvBlock, KvFetchRequest, KvTransferParams, NixlAgentInfo, RemoteBlocks
from services.lora_request import LoRARequest
from services.messages import (
    CacheConfigInfo,
    CachedRequestData,
    Empty,
    EngineStats,
    FirstTokenTimes,
    KvLoad,
    KvTierCounts,
    KvTierStats,
    KvTransferStats,
    LoraStats,
    NewRequestData,
    SpecDecodingStats,
    StepPlan,
    StepResult,
    TokenDelta,
    WorkerDescription,
)
from services.pooling_params import PoolerConfig, PoolingParams
from services.sampling_params import SamplingParams
from services.scheduler_messages import (
    AbortRequest,
    KvSnapshotRequest,
    KvSnapshotResponse,
    NumberedKvEvents,
    RemoveLoraRequest,
    ReplayOutputsRequest,
    StatsRequest,
    StepOutputs,
    StreamOutputsRequest,
    SubmitBatchRequest,
    SubmitBatchResponse,
    SubmitRequest,
    SubmitResult,
    TierEvents,
)
from services.structured_outputs import KINDS, StructuredOutputsParams
from services.tokenizer_api import ChatPrompt
from services.tokenizer_messages import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeBatchRequest,
    TokenizeBatchResponse,
    TokenizerChunk,
    TokenizerDescription,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeResult,
)
from services.transport.role_services import SCHEDULER, TOKENIZER, WORKER
from services.transport.rpc import encode, invalid_payload

# Every field differs from its default, so a field the wire format loses shows up.
FULL_PARAMS = SamplingParams(
    n=2, best_of=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, temperature=0.7,
    top_p=0.9, top_k=5, min_p=0.05, seed=-12345678901, logit_bias={5: 2.5, 9: -100.0}, allowed_token_ids=[1, 5, 9],
    bad_words=["darn"], stop=["\n", "END"], stop_token_ids=[7, 8], include_stop_str_in_output=True, ignore_eos=True,
    max_tokens=None, min_tokens=2, logprobs=3, prompt_logprobs=1, truncate_prompt_tokens=-1, skip_special_tokens=False,
    spaces_between_special_tokens=False,
    bad_words_token_ids=[[11, 12], [13]],
    structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True,
                                               field_name="response_format", reasoning_end_token_ids=(5, 6)),
    pooling=PoolingParams(normalize=False, dimensions=8, second_segment_start=3, use_activation=False),
)
POOLER = PoolerConfig("MEAN", False, True, 384, 64, ("no", "yes"))
LORA = LoRARequest("sql", 1 << 50, "/adapters/sql", "base")
# Dict order is the order that matters (best first, then the sampled token).
LOGPROBS = [{9: -0.25, 3: -1.5, 7: -8.0}, {2: -0.1}]
HANDOFF = KvTransferParams(True, True, "e1", [3, 4], "10.0.0.7", 50051, "p1", 2, True)
DELTA = TokenDelta("r", [9, 2], "stop", "END", LOGPROBS, LOGPROBS[1:], FirstTokenTimes(0.25, 1.5, 0.5), 16,
                   "worker unreachable", True, HANDOFF, [0.6, 0.8])
PLAN = StepPlan(
    step_id=41,
    new_requests=[NewRequestData("b", [5, 6, 7, 8], 3, [3, 4], 2, FULL_PARAMS, LORA)],
    cached_requests=[CachedRequestData("z", [9], 17, [42, 7]), CachedRequestData("a", [], 3)],
    num_scheduled_tokens={"z": 3, "b": 2, "a": 1},
    finished_request_ids=["gone", "preempted"],
    blocks_to_copy=[(1, 2)],
    blocks_to_swap_out=[(10, 0), (11, 1)],
    blocks_to_swap_in=[(5, 12)],
    kv_loads=[KvLoad("c", [(6, b"\x03" * 32, 2), (7, b"\x04" * 32, -1)], RemoteBlocks("10.0.0.7:50051", "p1", True, True))],
    kv_host_saves=[(8, 3)],
    kv_file_saves=[(9, b"\x05" * 32)],
    worker_instance_id="4f1c",
    scheduler_instance_id="9e2a",
    scheduled_spec_decode_tokens={"z": [11, 12]},
    draft_probes=["y"],
    kv_holds={"p1": [3, 4]},
    kv_hold_ends=["p0"],
)
TIER_COUNTS = KvTierCounts("SHARED", 1, 2, 3, 4, 5, 6, 7, [0.25], [b"\x06" * 32])
TIER_EVENTS = TierEvents("CPU", True, [b"\x07" * 32], [b"\x08" * 32])
CACHE_CONFIG = CacheConfigInfo(16, 100, 20, True, 0.9, 4.0, 64, "fp8")
CHAT = ChatPrompt([{"role": "user", "content": "hi", "name": "ann"},
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"arguments": {}}}]}],
                  add_generation_prompt=False, add_special_tokens=True, tools=[{"type": "function"}],
                  continue_final_message=True)
SUBMIT = SubmitRequest("r", [1, 2, 3], FULL_PARAMS, "g", "salt", [4, 5], HANDOFF, LORA)
TOKENIZED = TokenizeResponse([1, 2], "<s>hi", b"\x01\x02")

# Fields an example may leave at their default: one-of alternatives, and an alias.
_ALTERNATIVES = {*KINDS, "text", "guided_decoding"}
# One of each message, every field set (where a field has a default, away from it).
MESSAGES = [
    Empty(), FULL_PARAMS, FULL_PARAMS.structured_outputs, DELTA, PLAN,
    StepResult(7, {"a": [9], "b": [2, 4]}, {"a": LOGPROBS[:1]}, {"b": LOGPROBS}, {"c": 1}, [TIER_COUNTS], ["p1"],
               {"p": [0.6, 0.8]}, {"a": [3, 5]}),
    TIER_COUNTS,
    WorkerDescription(100, 20, 16, 2048, 49152, (2, 0), "4f1c", 2, 50, "ab" * 16, 737280, POOLER, False, True),
    FULL_PARAMS.pooling, POOLER,
    EngineStats(3, 4, 0.375, 5, 100, 1 << 40, 1 << 39, HistogramCounts((1, 0, 7), 23.0), CACHE_CONFIG, 64, 32,
                [KvTierStats("DISK", 1, 2, 3, 4, 5, 6, 7, HistogramCounts((1, 0), 0.5))],
                SpecDecodingStats(4, 16, 9, [4, 3, 2, 0]), {"local_compute": 6, "external_kv_transfer": 144},
                KvTransferStats(HistogramCounts((1, 0), 2e6), HistogramCounts((0, 1), 0.03), 1, 2, 3),
                LoraStats(2, ["sql"], ["chat", "fr"])),
    LORA, RemoveLoraRequest(7), LoraStats(2, ["sql"], ["chat"]),
    SUBMIT, SubmitBatchRequest([SUBMIT], "s1"), SubmitBatchResponse([SubmitResult(3, "temperature: bad")]),
    AbortRequest("r"), StatsRequest("s1"), StreamOutputsRequest("g"), ReplayOutputsRequest("g", 7, "s1"),
    StepOutputs([DELTA], "s1", 7, True), NumberedKvEvents("s1", 3, True, [b"\x00" * 32], [b"\x01" * 32],
                                                           [TIER_EVENTS]),
    KvSnapshotRequest("s1"), KvSnapshotResponse(3, [b"\x02" * 32], [TIER_EVENTS]), TIER_EVENTS,
    TokenizeRequest("text", CHAT, False, True), TokenizeBatchRequest([TokenizeRequest(chat=CHAT)]),
    TokenizeBatchResponse([TokenizeResult(TOKENIZED, "messages: must not be empty")]), TOKENIZED,
    DetokenizeRequest([1, 2], False, False), DetokenizeResponse("hi"), TokenizerDescription("m", 49152, 2, 1, True),
    TokenizerChunk(b"zip", "0" * 64),
    KvFetchRequest("p1", [3, 4], "float32:30x2x16x3x64", True, True), KvBlock(1, b"\x09" * 8, [7, 2]),
    NixlAgentInfo("kvfleet-a", b"\x0a" * 8, "DRAM", 0, 512, [2**40, 2**40 + 2**20]),
]


def _round_trip(message: msgspec.Struct) -> msgspec.Struct:
    return msgspec.msgpack.decode(encode(message), type=type(message))


def _left_at_default(message: msgspec.Struct) -> list[str]:
    """The fields with a default that the example leaves at it, one-of alternatives aside."""
    return [field.name for field in msgspec.structs.fields(message)
            if not field.required and field.name not in _ALTERNATIVES
            and getattr(message, field.name) == (field.default if field.default_factory is msgspec.NODEFAULT
                                                 else field.default_factory())]


def test_the_examples_cover_every_message_of_every_service() -> None:
    types = {t for service in (SCHEDULER, TOKENIZER, WORKER) for m in service.methods for t in (m.request, m.response)}
    assert types | {NumberedKvEvents} <= {type(message) for message in MESSAGES}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_round_trips_with_every_field_set(message: msgspec.Struct) -> None:
    assert _left_at_default(message) == []
    assert _round_trip(message) == message


def test_order_survives_the_wire() -> None:
    plan = _round_trip(PLAN)
    assert list(plan.num_scheduled_tokens) == ["z", "b", "a"] and plan.blocks_to_swap_out == [(10, 0), (11, 1)]
    assert list(_round_trip(DELTA).logprobs[0]) == [9, 3, 7]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(max_tokens=None, temperature=0.0), SamplingParams(allowed_token_ids=[0]),
     SamplingParams(stop="\n", top_k=-1, guided_decoding=StructuredOutputsParams(regex="a+"))],
    ids=["defaults", "no-limit-greedy", "one-allowed-token", "normalized"],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert _round_trip(params) == params


def test_defaults_stay_off_the_wire() -> None:
    assert msgspec.msgpack.decode(encode(SamplingParams())) == {}
    assert msgspec.msgpack.decode(encode(SamplingParams(temperature=0.0, max_tokens=None))) == {
        "temperature": 0.0, "max_tokens": None}


def _decode_error(payload: dict, message_type: type) -> msgspec.ValidationError:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.msgpack.decode(msgspec.msgpack.encode(payload), type=message_type)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": [], "field_name": "tool_choice"}}, "tool_choice"),
    ],
)
def test_values_the_definition_refuses_name_their_parameter(fields: dict, param: str) -> None:
    error = _decode_error({"request_id": "r", "prompt_token_ids": [1], "gateway_id": "g", "sampling_params": fields},
                          SubmitRequest)
    assert isinstance(error.__cause__, InvalidParameter) and error.__cause__.param == param
    assert invalid_payload(error).startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("payload", "details"),
    [
        ({"request_id": "r", "prompt_token_ids": [1], "gateway_id": "g", "sampling_params": {"n": "two"}},
         "sampling_params.n: Expected `int`, got `str`"),
        ({"request_id": "r", "prompt_token_ids": [1, "x"], "gateway_id": "g", "sampling_params": {}},
         "prompt_token_ids[1]: Expected `int`, got `str`"),
        ({"request_id": "r", "prompt_token_ids": [1], "sampling_params": {}},
         "gateway_id: is required"),
        ({"request_id": "", "prompt_token_ids": [1], "gateway_id": "g", "sampling_params": {}},
         "request_id: must not be empty"),
    ],
)
def test_a_malformed_field_is_named_by_its_path(payload: dict, details: str) -> None:
    assert invalid_payload(_decode_error(payload, SubmitRequest)) == details


def test_guided_decoding_is_structured_outputs_by_its_old_name() -> None:
    constraint = StructuredOutputsParams(choice=["a", "b"])
    params = SamplingParams(guided_decoding=constraint)
    assert params.structured_outputs == constraint and params.guided_decoding is None
    with pytest.raises(InvalidParameter, match="^guided_decoding: "):
        SamplingParams(guided_decoding=constraint, structured_outputs=constraint)
