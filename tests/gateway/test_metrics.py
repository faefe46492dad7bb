"""/metrics at parity with vLLM V1: every name of vLLM's own expected list, vLLM's
buckets, and the counts vLLM's test expects after real requests through a real server
(test_gateway's engine, an app of this module's own so counts start at zero). The
phases of a request add up: queue and prefill from the scheduler, decode from the
gateway, all within the end-to-end latency.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from tokenizer_svc.in_process import InProcessEncoder

from corpus import PROMPTS
from test_gateway import (  # noqa: F401  (fixtures)
    MODEL,
    ServerThread,
    Stack,
    _engine_idle_after_each_test,
    stack,
)

# vLLM's expected list and the part of it hidden by default (deprecated), as written in
# github.com/vllm-project/vllm tests/entrypoints/openai/test_metrics.py (EXPECTED_METRICS_V1,
# HIDDEN_DEPRECATED_METRICS) at commit 0419b117e5324b6b9e7a744034cd4a355d613eac.
EXPECTED_METRICS_V1 = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total",
    "vllm:cache_config_info",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_sum",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count",
    "vllm:request_params_n_sum",
    "vllm:request_params_n_bucket",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_sum",
    "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_sum",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_count",
]
HIDDEN_DEPRECATED_METRICS = [
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
]

# vLLM's buckets, as in github.com/vllm-project/vllm vllm/v1/metrics/loggers.py
# (PrometheusStatLogger) at commit 005a810bc40faa25b8870fbc8559c3462581eee3.
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
}
# build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... up to max_model_len.
TOKEN_COUNT_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                          "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens")
PHASES = ("queue", "prefill", "decode", "inference")


@pytest.fixture(scope="module")
def server(stack: Stack) -> Iterator[ServerThread]:
    with ServerThread(build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(server: ServerThread) -> str:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    return response.text


def samples(server: ServerThread) -> dict[str, float]:
    """Every sample, keyed `name{label=value,...}` without model_name."""
    found = {}
    for family in text_string_to_metric_families(scrape(server)):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def grown(before: dict[str, float], after: dict[str, float], names: list[str]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in names}


def test_every_metric_of_vllm_v1_is_there_with_vllm_buckets_and_counts(
    server: ServerThread, client: openai.OpenAI, stack: Stack
) -> None:
    prompt = stack.tokenizer.encode(PROMPTS[0])
    num_requests, max_tokens = 3, 5
    before = samples(server)
    for _ in range(num_requests):  # one at a time, so each engine step holds one request
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = scrape(server)
    shown = [name for name in EXPECTED_METRICS_V1 if name not in HIDDEN_DEPRECATED_METRICS]
    assert [name for name in shown if name not in text] == []
    # vLLM shows these only with --show-hidden-metrics-for-version; kvfleet never does.
    assert [name for name in HIDDEN_DEPRECATED_METRICS if name in text] == []
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_gc_collections_total",
                 "python_info"):
        assert f"\n{name}" in text

    families = {family.name: family for family in text_string_to_metric_families(text)}
    max_model_len = stack.core.max_model_len
    token_counts = [m * 10**e for e in range(10) for m in (1, 2, 5) if m * 10**e <= max_model_len]
    for name, bounds in {**BUCKETS, **dict.fromkeys(TOKEN_COUNT_HISTOGRAMS, token_counts)}.items():
        assert families[name].type == "histogram", name
        les = [float(s.labels["le"]) for s in families[name].samples if s.name == f"{name}_bucket"]
        assert les == [*map(float, bounds), math.inf], name

    # The counts vLLM's test_metrics_counts expects, with ITL where it reads the
    # deprecated time_per_output_token.
    after = samples(server)
    num_prompt_tokens = len(prompt)
    expected = {
        "vllm:time_to_first_token_seconds_count": num_requests,
        "vllm:inter_token_latency_seconds_count": num_requests * (max_tokens - 1),
        "vllm:e2e_request_latency_seconds_count": num_requests,
        **{f"vllm:request_{phase}_time_seconds_count": num_requests for phase in PHASES},
        "vllm:request_prompt_tokens_sum": num_requests * num_prompt_tokens,
        "vllm:request_prompt_tokens_count": num_requests,
        "vllm:request_generation_tokens_sum": num_requests * max_tokens,
        "vllm:request_generation_tokens_count": num_requests,
        "vllm:request_params_n_count": num_requests,
        "vllm:request_params_max_tokens_sum": num_requests * max_tokens,
        "vllm:request_params_max_tokens_count": num_requests,
        "vllm:iteration_tokens_total_sum": num_requests * (num_prompt_tokens + max_tokens),
        "vllm:iteration_tokens_total_count": num_requests * max_tokens,
        "vllm:prompt_tokens_total": num_requests * num_prompt_tokens,
        "vllm:generation_tokens_total": num_requests * max_tokens,
        "vllm:request_success_total{finished_reason=length}": num_requests,
    }
    assert grown(before, after, list(expected)) == expected

    # The phases nest: the scheduler's queue and prefill within the gateway's time to
    # first token, inference = prefill + decode, all within end to end.
    took = grown(before, after, [f"vllm:request_{phase}_time_seconds_sum" for phase in PHASES]
                 + ["vllm:time_to_first_token_seconds_sum", "vllm:e2e_request_latency_seconds_sum"])
    queue, prefill, decode, inference, ttft, e2e = took.values()
    assert queue >= 0 and prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    assert queue + prefill <= ttft and queue + inference <= e2e

    [config] = families["vllm:cache_config_info"].samples
    assert config.value == 1
    assert {k: config.labels[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
                                          "num_gpu_blocks_override")} == {
        "block_size": "16", "num_gpu_blocks": str(stack.core.description.num_kv_blocks),
        "enable_prefix_caching": "True", "cache_dtype": "auto", "num_gpu_blocks_override": "None",
    }


def test_a_parallel_request_is_metered_per_choice_and_once_as_a_whole(
    server: ServerThread, client: openai.OpenAI
) -> None:
    before = samples(server)
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, n=2, temperature=1.0, seed=7,
                              extra_body={"ignore_eos": True})
    expected = {
        "vllm:request_success_total{finished_reason=length}": 2,
        **{f"vllm:request_{phase}_time_seconds_count": 2 for phase in PHASES},
        "vllm:request_params_n_count": 1,
        "vllm:request_params_n_sum": 2,
        "vllm:request_max_num_generation_tokens_count": 1,
        "vllm:request_max_num_generation_tokens_sum": 4,
    }
    assert grown(before, samples(server), list(expected)) == expected


def test_a_stop_string_ends_the_phases_where_the_gateway_ends_the_request(
    server: ServerThread, client: openai.OpenAI
) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    # Greedy, the same text comes again: it stops at a word first seen a few tokens in.
    words = whole.split()
    stop = next(word for i, word in enumerate(words) if i >= 3 and word not in whole[: whole.index(word)])
    before = samples(server)
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and len(cut.text) < len(whole)
    after = samples(server)
    expected = {"vllm:request_success_total{finished_reason=stop}": 1,
                **{f"vllm:request_{phase}_time_seconds_count": 1 for phase in PHASES}}
    assert grown(before, after, list(expected)) == expected
    assert grown(before, after, ["vllm:request_decode_time_seconds_sum"])["vllm:request_decode_time_seconds_sum"] > 0
