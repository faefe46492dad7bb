"""The protos mirror services/messages.py and SamplingParams, and the conversions
round-trip them exactly, through the wire format."""
from __future__ import annotations

import dataclasses

import pytest

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
from services.pb.kvfleet.v1 import common_pb2, worker_pb2
from services.sampling_params import InvalidParameter, SamplingParams
from services.structured_outputs import StructuredOutputsParams
from services.transport import convert

# Every field differs from its default, so a field the conversion forgets shows up.
FULL_PARAMS = SamplingParams(
    n=2, best_of=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, temperature=0.7,
    top_p=0.9, top_k=5, min_p=0.05, seed=-12345678901, logit_bias={5: 2.5, 9: -100.0}, allowed_token_ids=[1, 5, 9],
    bad_words=["darn"], stop=["\n", "END"], stop_token_ids=[7, 8], include_stop_str_in_output=True, ignore_eos=True,
    max_tokens=32, min_tokens=2, logprobs=3, prompt_logprobs=1, truncate_prompt_tokens=-1, skip_special_tokens=False,
    spaces_between_special_tokens=False,
    bad_words_token_ids=[[11, 12], [13]],
    structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True,
                                               field_name="response_format", reasoning_end_token_ids=(5, 6)),
)
# Logprobs are float32 on the wire; these values are exact in float32. Dict order is
# the order that matters (best first, then the sampled token).
LOGPROBS = [{9: -0.25, 3: -1.5, 7: -8.0}, {2: -0.125}]


def _through_wire(message):
    return type(message).FromString(message.SerializeToString())


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


@pytest.mark.parametrize(
    ("dataclass", "proto"),
    [
        (SamplingParams, common_pb2.SamplingParams),
        (TokenDelta, common_pb2.TokenDelta),
        (EngineStats, common_pb2.EngineStats),
        (FirstTokenTimes, common_pb2.FirstTokenTimes),
        (HistogramCounts, common_pb2.HistogramCounts),
        (CacheConfigInfo, common_pb2.CacheConfigInfo),
        (WorkerDescription, worker_pb2.WorkerDescription),
        (NewRequestData, worker_pb2.NewRequestData),
        (CachedRequestData, worker_pb2.CachedRequestData),
        (StepPlan, worker_pb2.StepPlan),
        (StepResult, worker_pb2.StepResult),
    ],
)
def test_protos_mirror_the_dataclasses(dataclass, proto) -> None:
    python_fields = {f.name for f in dataclasses.fields(dataclass)}
    proto_fields = set(proto.DESCRIPTOR.fields_by_name)
    if proto is common_pb2.TokenDelta:  # stop_reason is a oneof of its two types; error and lost are transport-only
        proto_fields = proto_fields - {"stop_token_id", "stop_string", "error", "lost"} | {"stop_reason"}
    assert python_fields == proto_fields


def test_full_sampling_params_round_trip() -> None:
    assert all(getattr(FULL_PARAMS, f.name) != _default(f) for f in dataclasses.fields(SamplingParams))
    message = _through_wire(convert.sampling_params_to_proto(FULL_PARAMS))
    assert convert.sampling_params_from_proto(message) == FULL_PARAMS


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(max_tokens=None, temperature=0.0), SamplingParams(allowed_token_ids=[0])],
    ids=["defaults", "no-limit-greedy", "one-allowed-token"],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert convert.sampling_params_from_proto(_through_wire(convert.sampling_params_to_proto(params))) == params


def test_unset_fields_take_the_defaults_and_unset_max_tokens_is_no_limit() -> None:
    params = convert.sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert params == SamplingParams(temperature=0.0, max_tokens=None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"allowed_token_ids": common_pb2.TokenIds()}, "allowed_token_ids"),  # set, and empty
    ],
)
def test_invalid_values_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidParameter) as caught:
        convert.sampling_params_from_proto(common_pb2.SamplingParams(**fields))
    assert caught.value.param == param and str(caught.value).startswith(f"{param}: ")


def test_step_plan_round_trip_keeps_batch_order() -> None:
    plan = StepPlan(
        step_id=41,
        new_requests=[NewRequestData("b", [5, 6, 7, 8], 3, [3, 4], 2, FULL_PARAMS)],
        cached_requests=[CachedRequestData("z", [9], 17, [42, 7]), CachedRequestData("a", [], 3)],
        num_scheduled_tokens={"z": 1, "b": 2, "a": 1},
        finished_request_ids=["gone", "preempted"],
        blocks_to_copy=[(1, 2)],
        blocks_to_swap_out=[(10, 0), (11, 1)],
        blocks_to_swap_in=[(5, 12)],
        worker_instance_id="4f1c",
    )
    back = convert.plan_from_proto(_through_wire(convert.plan_to_proto(plan)))
    assert back == plan and list(back.num_scheduled_tokens) == ["z", "b", "a"]


def test_step_result_round_trip_keeps_logprob_order() -> None:
    result = StepResult(
        step_id=7, sampled_token_ids={"a": [9], "b": [2, 4]}, logprobs={"a": LOGPROBS[:1]},
        prompt_logprobs={"b": LOGPROBS},
    )
    back = convert.result_from_proto(_through_wire(convert.result_to_proto(result)))
    assert back == result and list(back.logprobs["a"][0]) == [9, 3, 7]
    assert convert.result_from_proto(convert.result_to_proto(StepResult(0))) == StepResult(0)


@pytest.mark.parametrize(
    "delta",
    [
        TokenDelta("r", [1, 2]),
        TokenDelta("r", [9, 2], "stop", None, LOGPROBS),
        TokenDelta("r", [4], None, None, LOGPROBS[1:], LOGPROBS),
        TokenDelta("r", [7], "stop", 7),
        TokenDelta("r", [], "stop", "END"),
        TokenDelta("r", [3], "length"),
        TokenDelta("r", [], "abort"),
        TokenDelta("r", [5], None, first_token_times=FirstTokenTimes(0.25, 1.5)),
    ],
)
def test_token_delta_round_trip(delta: TokenDelta) -> None:
    message = _through_wire(convert.delta_to_proto(delta))
    assert convert.delta_from_proto(message) == delta and message.error == ""


def test_token_delta_carries_the_error_that_ended_it() -> None:
    message = _through_wire(convert.delta_to_proto(TokenDelta("r", [], "abort"), "worker unreachable"))
    assert message.finish_reason == common_pb2.FINISH_REASON_ABORT and message.error == "worker unreachable"


def test_description_and_stats_round_trip() -> None:
    description = WorkerDescription(100, 20, 16, 2048, 49152, (2, 0), "4f1c")
    assert convert.description_from_proto(_through_wire(convert.description_to_proto(description))) == description
    cache_config = CacheConfigInfo(16, 100, 20, True, 0.9, 4.0, None, "auto")
    stats = EngineStats(3, 4, 0.375, 5, 100, 1 << 40, 1 << 39, HistogramCounts((1, 0, 7), 23.0), cache_config)
    for each in (stats, dataclasses.replace(stats, cache_config=None),
                 dataclasses.replace(stats, cache_config=dataclasses.replace(cache_config, num_gpu_blocks_override=0))):
        assert convert.stats_from_proto(_through_wire(convert.stats_to_proto(each))) == each
