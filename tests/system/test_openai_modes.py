"""The OpenAI API through the official `openai` client, against both ways of running
kvfleet as real process trees: `kvfleet serve` (embedded: one process) and
`kvfleet cluster up` (nats-server, Redis and every role as its own process).

Each mode starts once for the module, on a free port with an API key, and every test
runs against both: models; completions single, batched, echoed, with logprobs,
streamed; chat, whose streamed and whole answers are identical; stop strings; usage;
bad input and auth errors; 32 concurrent streams; metrics. Every greedy output is
checked against the offline SDK on the same weights, and the last test checks that
both modes gave identical outputs. (Structured outputs and tool calls are in
test_openai_structured.py; the bounds under a second, which want a quiet machine, in
test_openai_timing.py.)

The fixture also checks that `cluster up` runs every part as its own process, and
that SIGTERM stops either mode with exit code 0 and no process left behind. A failed
test shows the tail of the server's log (tests/conftest.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai_servers import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL,
    MODES,
    NUM_BLOCKS,
    PROC,
    SERVED,
    START_TIMEOUT_S,
    Server,
    alive,
    descendants,
    healthy,
    running_server,
)
from structured_schemas import SQL_GRAMMAR

from kvfleet import LLM, SamplingParams
from kvfleet.processes import free_port
from services.messages import Empty
from services.outputs import CompletionOutput
from services.scheduler_messages import StatsRequest
from services.transport import rpc

from corpus import CHAT, PROMPTS, TEXT

# Greedy outputs by mode (and the SDK's), for the cross-mode test at the end.
GREEDY: dict[str, dict[str, Any]] = {"sdk": {}, **{mode: {} for mode in MODES}}
# vLLM's server flags whose routes and bounds the issue 47 sections at the end test; nothing else here sees
# them (--max-logprobs -1, the whole vocabulary: test_max_logprobs_bounds_the_logprobs_a_request_asks_for).
ROOT_PATH = "/llm"
SERVER_FLAGS = ("--root-path", ROOT_PATH, "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
                "--show-hidden-metrics-for-version", "0.7", "--max-logprobs", "-1", "--enable-prompt-tokens-details")


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Every test runs over a disk tier a quarter of a GiB large (~340 blocks): loads and
    # evictions under the whole API's traffic, and never a different token.
    tiers = ("--kv-offloading-dir", str(tmp_path_factory.mktemp("kv-tier")), "--kv-offloading-dir-size", "0.25")
    with running_server(request.param, tmp_path_factory, *SERVER_FLAGS, *tiers) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def _idle_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle(timeout=5.0)


# -- the reference: the offline SDK on the same weights ----------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    """conftest checks after each test that it holds no block."""
    return LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS)


_SDK_CACHE: dict[tuple, list[CompletionOutput]] = {}


def sdk_greedy(llm: LLM, prompts: list[str] | list[list[int]], max_tokens: int) -> list[CompletionOutput]:
    """The SDK's greedy completions (computed once for both modes)."""
    key = ("generate", repr(prompts), max_tokens)
    if key not in _SDK_CACHE:
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        _SDK_CACHE[key] = [output.outputs[0] for output in outputs]
    return _SDK_CACHE[key]


def sdk_chat(llm: LLM, max_tokens: int) -> CompletionOutput:
    key = ("chat", max_tokens)
    if key not in _SDK_CACHE:
        [output] = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        _SDK_CACHE[key] = [output.outputs[0]]
    return _SDK_CACHE[key][0]


def record(server: Server, key: str, got: Any, sdk: Any) -> None:
    """Checks a greedy output against the SDK's, keeping both for the cross-mode test."""
    GREEDY[server.mode][key] = got
    GREEDY["sdk"][key] = sdk
    assert got == sdk, f"{server.mode}: {key} differs from the offline SDK"


def encode(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def chat_prompt_len(llm: LLM) -> int:
    return len(llm.get_tokenizer().apply_chat_template(CHAT))


def bearer(headers: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", **(headers or {})}


# -- models, completions ----------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_matches_the_offline_sdk(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    prompt = PROMPTS[0]
    response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == SERVED
    [choice] = response.choices
    [expected] = sdk_greedy(llm, [prompt], 12)
    record(server, "completion", (choice.text, choice.finish_reason), (expected.text, expected.finish_reason))
    ids = encode(llm, prompt)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 12)
    assert response.usage.total_tokens == len(ids) + 12


def test_batches_of_texts_and_token_ids(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    texts = PROMPTS[:3]
    ids = [encode(llm, text) for text in texts]
    expected = [output.text for output in sdk_greedy(llm, texts, 8)]
    for kind, prompt in (("texts", texts), ("token ids", ids)):
        response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0)
        assert [c.index for c in response.choices] == [0, 1, 2]
        record(server, f"batch of {kind}", [c.text for c in response.choices], expected)
        assert response.usage.prompt_tokens == sum(map(len, ids))
        assert response.usage.completion_tokens == 3 * 8
    single = client.completions.create(model=SERVED, prompt=ids[1], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[1]


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=SERVED, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=SERVED, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert plain.choices[0].text
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text
    assert echoed.usage == plain.usage


def test_completion_logprobs_in_the_legacy_format(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    response = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert top[token] == logprob == max(top.values())
    tokenizer = llm.get_tokenizer()
    [expected] = sdk_greedy(llm, [PROMPTS[2]], 8)
    record(server, "logprob tokens", logprobs.tokens, [tokenizer.decode([t]) for t in expected.token_ids])


def test_streamed_completion_with_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=SERVED, prompt=PROMPTS[3], max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=SERVED, prompt=PROMPTS[3], max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


# -- chat -------------------------------------------------------------------------------


def test_chat_streamed_and_whole_are_identical(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    args = dict(model=SERVED, messages=CHAT, max_completion_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))

    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion" and whole.model == SERVED
    message = whole.choices[0].message
    assert message.role == "assistant"
    expected = sdk_chat(llm, 16)
    record(server, "chat", (message.content, whole.choices[0].finish_reason), (expected.text, expected.finish_reason))

    first, *content, usage = chunks
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    streamed = "".join(c.choices[0].delta.content for c in content)
    record(server, "chat streamed", streamed, expected.text)
    # As vLLM: the last token comes with the finish reason.
    assert all(c.choices[0].finish_reason is None for c in [first, *content[:-1]])
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed_tokens = [t.token for c in content for t in c.choices[0].logprobs.content]
    assert streamed_tokens == [t.token for t in whole.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    # The same usage, but for the prompt tokens cached: the streamed one came second.
    assert usage.choices == [] and usage.usage.prompt_tokens_details.cached_tokens > 0
    assert usage.usage.model_copy(update={"prompt_tokens_details": None}) == whole.usage.model_copy(
        update={"prompt_tokens_details": None})
    assert whole.usage.completion_tokens == len(streamed_tokens) == len(expected.token_ids)
    assert whole.usage.prompt_tokens == chat_prompt_len(llm)


def test_chat_raw_sse_format(server: Server) -> None:
    body = {"model": SERVED, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=bearer()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"delta":{"role":"assistant","content":""}' in lines[0]
    assert re.search(r'"delta":\{"content":"[^"]+"\},"logprobs":null,"finish_reason":"length"', lines[-2]), lines[-2]


# -- stop strings -------------------------------------------------------------------------


def _stop_string_case(client: openai.OpenAI, llm: LLM, straddle: bool) -> tuple[dict, str, str]:
    """(request args, a stop string, the text before it) from a greedy run. The stop
    string starts on a token boundary, or (straddle) one character before it. The args
    ask for the rest of the context, ignoring EOS: only an abort ends that request soon."""
    args = dict(model=SERVED, messages=CHAT, temperature=0)
    free = client.chat.completions.create(**args, max_tokens=16, logprobs=True).choices[0]
    tokens = [t.token for t in free.logprobs.content]
    k = len(tokens) // 2
    start = len("".join(tokens[:k])) - straddle
    stop = free.message.content[start : start + 3]
    assert free.message.content.index(stop) == start and stop.strip(), (stop, free.message.content)
    long = dict(args, max_tokens=MAX_MODEL_LEN - chat_prompt_len(llm), extra_body={"ignore_eos": True})
    return long, stop, free.message.content[:start]


def test_stop_strings_end_the_text_and_free_the_request(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    args, stop, cut = _stop_string_case(client, llm, straddle=False)
    whole = client.chat.completions.create(**args, stop=[stop])
    ended = time.monotonic()
    assert whole.choices[0].message.content == cut
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop
    assert whole.usage.completion_tokens < 16
    # The engine knows nothing of stop strings: the gateway aborted the request.
    server.wait_idle(since=ended)
    stream = client.chat.completions.create(**args, stop=stop, stream=True)
    chunks = list(stream)
    ended = time.monotonic()
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.wait_idle(since=ended)


def test_a_stop_string_that_starts_in_an_earlier_delta(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    args, stop, cut = _stop_string_case(client, llm, straddle=True)
    assert client.chat.completions.create(**args, stop=[stop]).choices[0].message.content == cut
    server.wait_idle(since=time.monotonic())


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"10000000": 5}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_field(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=4, extra_body=extra)
    assert caught.value.param == param and caught.value.message


def test_missing_messages_and_bad_prompts_are_400(server: Server, client: openai.OpenAI) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": SERVED}, headers=bearer())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=SERVED, prompt=[], max_tokens=4)
    assert caught.value.param == "prompt"
    not_json = httpx.post(f"{server.url}/v1/completions", content=b"{",
                          headers=bearer({"content-type": "application/json"}))
    assert not_json.status_code == 400 and "error" in not_json.json()


def test_a_bad_prompt_in_a_batch_rejects_the_whole_batch(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    good = encode(llm, PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=SERVED, prompt=[good, [10**9]], max_tokens=MAX_MODEL_LEN - len(good), extra_body={"ignore_eos": True}
        )
    rejected = time.monotonic()
    assert caught.value.param == "prompt" and str(10**9) in caught.value.message
    # The good prompt's request (the rest of the context to go) was aborted with the batch.
    server.wait_idle(since=rejected)


def test_too_long_prompt_states_both_lengths(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=SERVED, prompt=[1] * (MAX_MODEL_LEN + 1), max_tokens=4)
    assert caught.value.param == "prompt"
    message = caught.value.message
    assert str(MAX_MODEL_LEN + 1) in message and str(MAX_MODEL_LEN) in message.replace(str(MAX_MODEL_LEN + 1), "")


def test_unknown_model_and_route_are_404(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)  # served as SERVED only
    assert caught.value.param == "model"
    response = httpx.get(f"{server.url}/v1/no-such-route", headers=bearer())
    assert response.status_code == 404 and "error" in response.json()


# -- auth -------------------------------------------------------------------------------------


def test_the_api_key_guards_v1_but_not_health_or_metrics(server: Server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
    anonymous = httpx.post(f"{server.url}/v1/completions", json={"model": SERVED, "prompt": "hi"})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


# -- concurrency, disconnects, metrics ----------------------------------------------------------


def test_32_concurrent_streams_match_the_offline_sdk(server: Server, llm: LLM) -> None:
    prompts = PROMPTS * 4
    outputs = sdk_greedy(llm, PROMPTS, 12)
    expected = {prompt: (output.text, output.finish_reason) for prompt, output in zip(PROMPTS, outputs)}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=SERVED, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    record(server, "32 streams", asyncio.run(run()), [expected[p] for p in prompts])


def test_metrics_use_vllm_names(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    before = server.metrics()
    client.completions.create(model=SERVED, prompt=PROMPTS[4], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    # The first scrape after the answer sees all of it, in cluster mode too (no poller's lag).
    after = server.metrics()
    assert not any(after[name] for name in
                   ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")), after
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "process_cpu_seconds_total"):
        assert name in after
    # In cluster mode too: what only a scheduler knows (the phases' times, tokens per step, its cache) reaches the gateway.
    assert any(name.startswith("vllm:cache_config_info{") for name in after)
    num_prompt_tokens = len(encode(llm, PROMPTS[4]))
    grew = {
        "vllm:generation_tokens_total": 5,
        "vllm:prompt_tokens_total": num_prompt_tokens,
        "vllm:request_success_total{finished_reason=length}": 1,
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:inter_token_latency_seconds_count": 4,
        "vllm:e2e_request_latency_seconds_count": 1,
        **{f"vllm:request_{phase}_time_seconds_count": 1 for phase in ("queue", "prefill", "decode", "inference")},
        "vllm:request_prompt_tokens_sum": num_prompt_tokens,
        "vllm:request_generation_tokens_sum": 5,
        "vllm:request_params_n_count": 1,
        "vllm:iteration_tokens_total_count": 5,
        "vllm:iteration_tokens_total_sum": num_prompt_tokens + 5,
    }
    assert {name: after[name] - before.get(name, 0.0) for name in grew} == grew
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert not any(name.endswith("_created") for name in after)


# -- supervision (last of a mode's tests: it kills a role) -------------------------------------


def role_pid(server: Server, role: str) -> int:
    for pid in descendants(server.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "kvfleet.cli" in argv and argv[argv.index("kvfleet.cli") + 1] == role and alive(pid):
            return pid
    raise AssertionError(f"no live {role} under the launcher\n{server.log_tail()}")


def test_cluster_up_restarts_a_killed_worker_and_serves_again(server: Server, client: openai.OpenAI) -> None:
    if server.mode != "cluster" or not PROC:
        pytest.skip("cluster up's supervision, seen through /proc")
    killed = role_pid(server, "worker")
    os.kill(killed, signal.SIGKILL)
    began = time.monotonic()
    while healthy(server.url):  # its lease lapses
        assert time.monotonic() - began < 30, server.log_tail()
        time.sleep(0.2)
    while not healthy(server.url):  # restarted after its backoff, loaded, and taken up: no cluster restart
        assert time.monotonic() - began < START_TIMEOUT_S, server.log_tail()
        time.sleep(0.25)
    reply = client.completions.create(model=SERVED, prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    assert server.process.poll() is None and role_pid(server, "worker") != killed
    assert "worker exited with code -9; restarting it" in server.log_tail()


def test_cluster_roles_take_calls_with_the_cluster_token_only(server: Server) -> None:
    """cluster up gives its roles a token of their own, through the environment (never
    the command line); without it each role's gRPC port refuses every call."""
    if server.mode != "cluster" or not PROC:
        pytest.skip("cluster up's roles, seen through /proc")
    calls = {"tokenizer": ("/kvfleet.v1.Tokenizer/Describe", Empty()),
             "worker": ("/kvfleet.v1.Worker/Describe", Empty()),
             "scheduler": ("/kvfleet.v1.Scheduler/Stats", StatsRequest())}
    tokens = set()
    for role, (method, request) in calls.items():
        pid = role_pid(server, role)
        environment = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in entry)
        token = environment["KVFLEET_CLUSTER_TOKEN"]
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert len(token) >= 32 and not any(token in arg for arg in argv)
        tokens.add(token)
        port = argv[argv.index("--port") + 1]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(method, request_serializer=rpc.encode)
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, role
            call(request, timeout=10, metadata=[("x-kvfleet-cluster-token", token)])
    assert len(tokens) == 1  # one cluster, one token


def test_cluster_nats_and_redis_take_this_cluster_s_credentials_only(server: Server) -> None:
    """A client without them can neither subscribe to NATS (every gateway's token stream
    passes there) nor write a lease into Redis (a fake scheduler); the roles got them
    through the environment, and no process's command line shows them."""
    if server.mode != "cluster" or not PROC:
        pytest.skip("cluster up's processes, seen through /proc")
    import nats
    import redis
    from nats.errors import NoServersError

    pid = role_pid(server, "scheduler")
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    nats_url, redis_url = argv[argv.index("--nats-url") + 1], argv[argv.index("--redis-url") + 1]
    environment = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
                       if "=" in entry)
    secrets = [environment[name] for name in ("KVFLEET_NATS_PASSWORD", "KVFLEET_REDIS_PASSWORD")]
    for process in descendants(server.process.pid) | {server.process.pid}:
        try:
            cmdline = Path(f"/proc/{process}/cmdline").read_text()
        except OSError:
            continue
        assert not any(secret in cmdline for secret in secrets), cmdline

    async def subscribe(**credentials: str) -> None:
        client = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0,
                                    **credentials)
        await client.subscribe("kvfleet.out.>")
        await client.flush(timeout=2)
        await client.close()

    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        asyncio.run(subscribe())
    asyncio.run(subscribe(user=environment["KVFLEET_NATS_USER"], password=secrets[0]))
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_url).set("kvfleet:role:scheduler:fake", "{}")
    assert redis.Redis.from_url(redis_url, password=secrets[1]).ping()


# -- across the modes ---------------------------------------------------------------------------


def test_the_start_up_summary_says_what_serves(server: Server) -> None:
    """What a person reads in the output once the server is up; in a cluster, each role's
    lines behind its name, and NATS and Redis in files of their own."""
    log = server.log_path.read_text(errors="replace")
    lines = {
        "model smollm2:": "(llama, 30 layers)",
        "worker_svc.runtime.worker: weights:": "GGUF Q4_1+Q8_0, its 4-bit projections and 8-bit embedding run as stored",
        "KV cache:": f"{NUM_BLOCKS} blocks of 16 tokens = {NUM_BLOCKS * 16} tokens",
        "maximum concurrency at": f"max_model_len {MAX_MODEL_LEN}: {NUM_BLOCKS * 16 / MAX_MODEL_LEN:.1f}x",
        "routes:": "POST /v1/chat/completions",
        f"serving {SERVED} on": f"{server.url} (OpenAI API: {server.url}/v1)",
    }
    for key, value in lines.items():
        line = next((line for line in log.splitlines() if key in line), "")
        assert value in line, f"{key!r} ... {value!r} not in the log:\n{server.log_tail()}"
        if server.mode == "cluster":
            assert re.search(r"^ *(worker|gateway) \| ", line), line
    if server.mode == "cluster":
        for role in ("tokenizer", "worker", "scheduler"):
            assert re.search(rf"kvfleet.cluster: {role}: gRPC on 127.0.0.1:\d+", log), role
        logs_dir = Path(re.search(r"their logs: (\S+)", log)[1])
        assert (logs_dir / "nats.log").is_file() and (logs_dir / "redis.log").is_file()
        assert "[INF]" not in log  # nats-server's lines stay in its file
    assert '"GET /health HTTP/1.1"' not in log  # probes' access lines are dropped


def test_greedy_outputs_are_identical_in_both_modes_and_equal_the_sdk() -> None:
    """Runs after both modes' tests (pytest orders a module-scoped parametrized fixture's
    tests by parameter; this one takes no server)."""
    absent = [mode for mode in MODES if not GREEDY[mode]]
    if absent:
        pytest.skip(f"no greedy output recorded in mode {absent} (deselected?)")
    serve, cluster, sdk = GREEDY["serve"], GREEDY["cluster"], GREEDY["sdk"]
    assert serve.keys() == cluster.keys() == sdk.keys(), "a mode's greedy test failed before recording"
    for key in sdk:
        assert serve[key] == cluster[key] == sdk[key], key


# -- issue 47: vLLM's streamed endings, default model, logprobs, echo, model cards and error wording --

# smollm2's token 0, a special token that decoding skips by default.
END_OF_TEXT = (0, "<|endoftext|>")


def test_the_last_streamed_chunk_carries_the_last_token_and_the_finish_reason(client: openai.OpenAI) -> None:
    """As vLLM streams it: chat and completions alike, no empty chunk after the last token."""
    args = dict(model=SERVED, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**args, messages=CHAT, logprobs=True)
    chunks = list(client.chat.completions.create(**args, messages=CHAT, logprobs=True, stream=True))
    assert [c for c in chunks if c.choices[0].finish_reason] == [chunks[-1]]
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason == "length"
    last_token = whole.choices[0].logprobs.content[-1].token
    assert last.delta.content and last.delta.content.endswith(last_token)
    assert last.logprobs.content[-1].token == last_token
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    text = client.completions.create(**args, prompt=PROMPTS[0]).choices[0].text
    chunks = list(client.completions.create(**args, prompt=PROMPTS[0], stream=True))
    assert [c for c in chunks if c.choices[0].finish_reason] == [chunks[-1]]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == text


def test_a_request_that_names_no_model_gets_the_served_one(server: Server, client: openai.OpenAI) -> None:
    """As vLLM: `model` absent, null or empty serves the default model."""
    assert client.completions.create(model="", prompt="Hi", max_tokens=2).model == SERVED
    for model in ({}, {"model": None}, {"model": ""}):
        body = {**model, "messages": CHAT, "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=bearer(), timeout=60)
        assert response.status_code == 200 and response.json()["model"] == SERVED, (model, response.text)


def test_logprobs_0_shows_the_sampled_tokens_own_logprob(client: openai.OpenAI) -> None:
    """Completions' logprobs=n lists the token itself and up to n others (vLLM's, and OpenAI's
    legacy API); chat's top_logprobs=0 lists none, as vLLM does."""
    logprobs = client.completions.create(model=SERVED, prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                         logprobs=0).choices[0].logprobs
    assert logprobs.top_logprobs == [{token: logprob} for token, logprob in zip(logprobs.tokens,
                                                                                logprobs.token_logprobs)]
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=0).choices[0].logprobs.content
    assert len(chat) == 4 and all(entry.top_logprobs == [] for entry in chat)


def test_echo_of_special_token_ids_agrees_in_text_tokens_and_offsets(client: openai.OpenAI) -> None:
    """vLLM's echo: special tokens of a token-id prompt show in the text as in the tokens."""
    token_id, text = END_OF_TEXT
    args = dict(model=SERVED, prompt=[token_id] * 5, max_tokens=4, temperature=0, echo=True, logprobs=0)
    choice = client.completions.create(**args).choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(text * 5) and logprobs.tokens[:5] == [text] * 5
    assert choice.text == "".join(logprobs.tokens)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert logprobs.top_logprobs[0] is None
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])  # logprobs=0: the token's own
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == logprobs.tokens


def test_model_cards_carry_root_parent_and_permission(client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert (card.model_extra["root"], card.model_extra["parent"]) == (MODEL, None)
    [permission] = card.model_extra["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {key: permission[key] for key in ("allow_sampling", "allow_logprobs", "allow_view", "organization",
                                             "group", "is_blocking")} == {
        "allow_sampling": True, "allow_logprobs": True, "allow_view": True, "organization": "*", "group": None,
        "is_blocking": False}


def test_errors_in_vllms_words_naming_kvfleets_fields(client: openai.OpenAI) -> None:
    """The wording vLLM's clients and tests match on, with `param` naming the field."""
    def refused(create, **args) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=SERVED, max_tokens=4, **args)
        return caught.value

    for seed, bound in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        error = refused(client.chat.completions.create, messages=CHAT, seed=seed)
        assert error.param == "seed" and f"[type={bound}, input_value={seed}, input_type=int]" in error.message
    error = refused(client.chat.completions.create, messages=CHAT, logit_bias={"bad1": 1, "bad2": 2})
    assert error.param == "logit_bias" and "bad1" in error.message and "bad2" in error.message
    error = refused(client.completions.create, prompt=[999999])
    assert error.param == "prompt" and "Token id 999999 is out of vocabulary" in error.message
    for prompt in ("", [], [[]], ["Hi", ""]):
        error = refused(client.completions.create, prompt=prompt)
        assert error.param == "prompt" and "decoder prompt cannot be empty" in error.message
        assert "Either prompt or prompt_embeds must be provided and non-empty." in error.message


# -- issue 47: /tokenize's shape, tools, Lark grammars ------------------------------------------


def test_tokenize_and_detokenize_answer_in_vllm_s_shape(server: Server, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()

    def tokenize(**body: Any) -> httpx.Response:
        return httpx.post(f"{server.url}/tokenize", json={"model": SERVED, **body}, headers=bearer())

    prompt = "Hello world<|endoftext|> vllm1"
    ids = tokenizer.encode(prompt)
    assert tokenize(prompt=prompt).json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                                              "token_strs": None}
    assert tokenize(prompt=prompt, return_token_strs=True).json() == {
        "count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=False)}
    # A chat whose last message the model is to continue, with tools for the template.
    messages = [*CHAT, {"role": "assistant", "content": "Sure,"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    text = tokenizer.render_chat(messages, False, tools, continue_final_message=True)
    assert text.endswith("Sure,")
    ids = tokenizer.encode(text, add_special_tokens=False)
    chat = tokenize(messages=messages, tools=tools, add_generation_prompt=False, continue_final_message=True,
                    return_token_strs=True)
    assert chat.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                           "token_strs": tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=False)}
    both = tokenize(messages=messages, continue_final_message=True)  # add_generation_prompt defaults to true
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    bad_tool = tokenize(messages=messages, tools=[{"type": "function"}])
    assert bad_tool.status_code == 400 and "tools" in bad_tool.json()["error"]["message"]
    # Special tokens are text like any other, as vLLM's /detokenize writes them.
    back = httpx.post(f"{server.url}/detokenize", json={"model": SERVED, "tokens": tokenizer.encode(prompt)},
                      headers=bearer())
    assert back.json() == {"prompt": prompt}


# A tool whose arguments name a definition of its own by `$ref` (as pydantic writes schemas), and one without.
OPTIONS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
           "additionalProperties": False}
REF_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "options"], "$defs": {"Options": OPTIONS},
        "properties": {"city": {"type": "string", "maxLength": 12}, "options": {"$ref": "#/$defs/Options"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
]


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_answer_as_vllm_does(client: openai.OpenAI, tool_choice: str) -> None:
    """$refs into a tool's $defs hold; the content is "", and a call cut short by
    max_tokens is no call at all."""
    import jsonschema

    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else "required"
    args = dict(model=SERVED, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=REF_TOOLS,
                tool_choice=choice, parallel_tool_calls=False, temperature=0)
    whole = client.chat.completions.create(**args, max_tokens=100).choices[0]
    assert whole.message.content == "" and whole.finish_reason == ("stop" if tool_choice == "named" else "tool_calls")
    [call] = whole.message.tool_calls
    schema = next(tool["function"]["parameters"] for tool in REF_TOOLS if tool["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    cut = client.chat.completions.create(**args, max_tokens=3).choices[0]
    assert (cut.finish_reason, cut.message.content, cut.message.tool_calls) == ("length", "", [])
    clash = [REF_TOOLS[0], {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"o": {"$ref": "#/$defs/Options"}}, "$defs": {"Options": {"type": "string"}}}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**args, "tools": clash, "tool_choice": "required"}, max_tokens=4)
    assert caught.value.param == "tools" and "Options" in caught.value.message


def test_lark_grammars_are_taken_as_vllm_takes_them(server: Server, client: openai.OpenAI) -> None:
    """structured_outputs.grammar and guided_grammar in Lark's syntax are converted to
    EBNF; one that does not convert is a 400 naming the field and what does not."""
    sql = re.compile(r"SELECT col_[12] from table_[12] where col_[12]=[12]")
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=30, temperature=0,
                                          extra_body={"structured_outputs": {"grammar": SQL_GRAMMAR}})
    assert sql.fullmatch(chat.choices[0].message.content), chat.choices[0].message.content
    completion = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                           extra_body={"guided_grammar": SQL_GRAMMAR})
    assert sql.fullmatch(completion.choices[0].text), completion.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=4,
                                  extra_body={"guided_grammar": "start: select_statement"})
    assert caught.value.param == "guided_grammar" and "select_statement" in caught.value.message


# -- issue 47: server features (--root-path, /load, /tokenizer_info, /invocations, hidden metrics) --


def test_root_path_serves_with_and_without_it_and_the_key_guards_both(server: Server) -> None:
    """vLLM's --root-path behind a path-rewriting proxy: /llm/v1 and /v1 both serve,
    and --api-key guards both; the operational routes stay open under it too."""
    for base in (f"{server.url}{ROOT_PATH}/v1", f"{server.url}/v1"):
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
        with openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=60) as right:
            reply = right.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
            assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    for route in ("health", "load", "version", "metrics"):
        assert httpx.get(f"{server.url}{ROOT_PATH}/{route}").status_code == 200, route


def test_load_counts_the_generation_requests_being_answered(server: Server, client: openai.OpenAI) -> None:
    """--enable-server-load-tracking: GET /load is vLLM's {"server_load": N}, counting a
    request from its arrival to its response's end (a stream's too)."""

    def load() -> dict[str, int]:
        return httpx.get(f"{server.url}/load", timeout=10).json()

    assert load() == {"server_load": 0}
    stream = client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # its first chunk: it is being answered
    assert load() == {"server_load": 1}
    stream.close()  # the client leaves: the request ends
    deadline = time.monotonic() + 2.0
    while load() != {"server_load": 0}:
        assert time.monotonic() < deadline, load()
        time.sleep(0.05)
    client.completions.create(model=SERVED, prompt="Hi", max_tokens=2)
    assert load() == {"server_load": 0}


def test_tokenizer_info_in_vllm_s_shape(server: Server) -> None:
    """--enable-tokenizer-info-endpoint: the tokenizer's configuration as vLLM gives it
    (init arguments, special tokens as text, the class, the chat template), the same in
    both modes as the tokenizer the SDK loads."""
    from services.model_source import resolve_model
    from tokenizer_svc.tokenizer import Tokenizer

    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    expected = json.loads(json.dumps(Tokenizer.load(resolve_model(MODEL)).info()))
    assert info == expected
    # vLLM's schema test (tests/entrypoints/openai/test_tokenization.py), field by field.
    types = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool, "bos_token": str,
             "eos_token": str, "pad_token": str, "unk_token": str, "chat_template": str, "model_max_length": int,
             "additional_special_tokens": list, "added_tokens_decoder": dict}
    for field, kind in types.items():
        assert info.get(field) is None or isinstance(info[field], kind), field
    assert info["tokenizer_class"] and "{% for message in messages %}" in info["chat_template"]
    assert "vocab_file" not in info and info["added_tokens_decoder"]["0"] == "<|endoftext|>"
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": SERVED, "prompt": "Hello"}).json()
    assert info["model_max_length"] >= tokenized["max_model_len"]


def test_invocations_answer_as_the_route_the_body_is_for(server: Server, client: openai.OpenAI) -> None:
    """SageMaker's POST /invocations: a chat body gets the chat completion, a completion
    body the completion (greedy: the very same text as the /v1 route's); it needs the API
    key (vLLM's does not: its issue #58144); /ping answers as /health."""
    chat = {"model": SERVED, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    completion = {"model": SERVED, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    direct_chat = client.chat.completions.create(**chat).choices[0].message.content
    direct_completion = client.completions.create(**completion).choices[0].text
    via_chat = httpx.post(f"{server.url}/invocations", json=chat, headers=bearer(), timeout=60).json()
    assert via_chat["object"] == "chat.completion" and via_chat["choices"][0]["message"]["content"] == direct_chat
    via_completion = httpx.post(f"{server.url}/invocations", json=completion, headers=bearer(), timeout=60).json()
    assert via_completion["object"] == "text_completion" and via_completion["choices"][0]["text"] == direct_completion
    streamed = httpx.post(f"{server.url}/invocations", json={**completion, "stream": True}, headers=bearer(), timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream") and streamed.text.endswith("[DONE]\n\n")
    assert httpx.post(f"{server.url}/invocations", json=completion).status_code == 401
    unknown = httpx.post(f"{server.url}/invocations", json=["hi"], headers=bearer())
    assert unknown.status_code == 400 and unknown.json()["error"]["message"] == (
        "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']")
    bad_chat = httpx.post(f"{server.url}/invocations", json={**chat, "max_tokens": "many"}, headers=bearer())
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200


def test_show_hidden_metrics_for_version_is_accepted_and_said_to_change_nothing(server: Server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "--show-hidden-metrics-for-version has no effect: kvfleet hides no metric" in log, server.log_tail()
    assert "vllm:num_requests_running" in server.metrics()


# -- issue 47: request-level features (usage in every chunk, token ids, logprob bounds, echo) --


def test_continuous_usage_stats_tell_the_usage_so_far_in_every_chunk(client: openai.OpenAI, llm: LLM) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    *body, total = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             stream=True, stream_options=options)
    assert total.choices == [] and total.usage.completion_tokens == 6
    assert total.usage.prompt_tokens == len(encode(llm, PROMPTS[0]))
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(set(counts)) and counts[-1] == 6  # each chunk's count, after its tokens
    assert all(c.usage.prompt_tokens == total.usage.prompt_tokens for c in body)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)
    *body, total = client.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=6, temperature=0,
                                                  stream=True, stream_options=options)
    assert total.choices == [] and total.usage.prompt_tokens == chat_prompt_len(llm)
    counts = [c.usage.completion_tokens for c in body]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == total.usage.completion_tokens  # role first
    # As vLLM: continuous_usage_stats says nothing without include_usage.
    quiet = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=3, temperature=0, stream=True,
                                      stream_options={"continuous_usage_stats": True})
    assert all(c.usage is None for c in quiet)


def test_return_token_ids_give_the_prompt_s_and_each_choice_s_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    [expected] = sdk_greedy(llm, [PROMPTS[1]], 6)
    args = dict(model=SERVED, prompt=PROMPTS[1], max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    [whole] = client.completions.create(**args).choices
    assert whole.prompt_token_ids == encode(llm, PROMPTS[1]) and whole.token_ids == list(expected.token_ids)
    streamed = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert streamed[0].prompt_token_ids == whole.prompt_token_ids  # with the first chunk only
    assert not any("prompt_token_ids" in c.model_extra for c in streamed[1:])
    assert [token for c in streamed for token in c.token_ids] == whole.token_ids
    assert client.completions.create(**{**args, "extra_body": {}}).choices[0].token_ids is None

    chat_args = dict(model=SERVED, messages=CHAT, max_completion_tokens=6, temperature=0,
                     extra_body={"return_token_ids": True})
    chat = client.chat.completions.create(**chat_args)
    assert chat.prompt_token_ids == llm.get_tokenizer().apply_chat_template(CHAT)
    assert chat.choices[0].token_ids == list(sdk_chat(llm, 6).token_ids)
    first, *rest = client.chat.completions.create(**chat_args, stream=True)
    assert first.prompt_token_ids == chat.prompt_token_ids
    assert not any("prompt_token_ids" in c.model_extra for c in rest)
    assert [token for c in rest for token in c.choices[0].model_extra.get("token_ids", [])] == chat.choices[0].token_ids


def test_return_tokens_as_token_ids_name_each_token_by_its_id(client: openai.OpenAI, llm: LLM) -> None:
    as_ids = {"return_tokens_as_token_ids": True}
    [expected] = sdk_greedy(llm, [PROMPTS[2]], 8)
    echoed = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, echo=True,
                                       logprobs=1, extra_body=as_ids).choices[0]
    prompt_ids = encode(llm, PROMPTS[2])
    assert echoed.logprobs.tokens == [f"token_id:{t}" for t in [*prompt_ids, *expected.token_ids]]
    # As vLLM's: each entry of top_logprobs names its own token first.
    assert [next(iter(top)) for top in echoed.logprobs.top_logprobs[1:]] == echoed.logprobs.tokens[1:]
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=1, extra_body=as_ids)
    names = [f"token_id:{t}" for t in sdk_chat(llm, 6).token_ids]
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [t.top_logprobs[0].token for t in content] == names
    assert b"".join(bytes(t.bytes) for t in content).decode() == chat.choices[0].message.content  # still the text's


def test_max_logprobs_bounds_the_logprobs_a_request_asks_for(client: openai.OpenAI, llm: LLM) -> None:
    """The servers run with --max-logprobs -1: -1 asks for the whole vocabulary, more
    is refused in vLLM's words (the default of 20 is tests/gateway's)."""
    vocab = llm.get_tokenizer().vocab_size
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_completion_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=-1)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
    # Four prompt positions of the whole vocabulary: more than NATS's default 1 MB in one message.
    prompt = "The history of the lighthouse"
    [choice] = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1,
                                         extra_body={"prompt_logprobs": -1}).choices
    entries = choice.prompt_logprobs
    assert entries[0] is None and len(entries) == len(encode(llm, prompt)) >= 5
    assert all(len(entry) == vocab for entry in entries[1:])
    refused = [
        (client.completions.create, {"prompt": "Hi", "logprobs": vocab + 1}, "logprobs",
         f"Requested sample logprobs of {vocab + 1}, which is greater than max allowed: {vocab}"),
        (client.completions.create, {"prompt": "Hi", "extra_body": {"prompt_logprobs": vocab + 1}}, "prompt_logprobs",
         f"Requested prompt logprobs of {vocab + 1}, which is greater than max allowed: {vocab}"),
        (client.chat.completions.create, {"messages": CHAT, "logprobs": True, "top_logprobs": vocab + 1},
         "top_logprobs", f"Requested sample logprobs of {vocab + 1}, which is greater than max allowed: {vocab}"),
        (client.completions.create, {"prompt": "Hi", "logprobs": -2}, "logprobs",
         "`logprobs` must be a positive value or -1."),
    ]
    for create, extra, param, message in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=SERVED, max_tokens=1, **extra)
        assert caught.value.param == param and message in caught.value.message


def test_echo_with_continue_final_message_goes_on_with_the_last_message(client: openai.OpenAI, llm: LLM) -> None:
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    args = dict(model=SERVED, messages=messages, max_completion_tokens=8, temperature=0)
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**args, extra_body=go_on).choices[0].message
    # The model continued the open message: the SDK's greedy continuation of the same prompt.
    prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.get_tokenizer().decode(prompt).endswith(saying)
    [expected] = sdk_greedy(llm, [prompt], 8)
    assert (plain.role, plain.content) == ("assistant", expected.text)
    echoed = client.chat.completions.create(**args, extra_body={**go_on, "echo": True}).choices[0].message
    assert echoed.content == saying + plain.content
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body={**go_on, "echo": True}))
    assert chunks[1].choices[0].delta.content == saying  # right after the role's
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.content
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(**args, extra_body={"continue_final_message": True})  # with the default
    assert both.value.param == "continue_final_message" and "`add_generation_prompt`" in both.value.message


def test_a_cluster_gateway_takes_the_response_flags(server: Server, tmp_path: Path) -> None:
    """--enable-force-include-usage, --return-tokens-as-token-ids and
    --enable-prompt-tokens-details (completions too) on a second gateway of the running
    cluster, started as cluster up started its own (in serve mode: tests/gateway/test_gateway.py
    on the embedded app; tests/kvfleet/test_cli.py, the flags reaching both)."""
    if server.mode != "cluster" or not PROC:
        pytest.skip("a second gateway of the cluster, started like its own through /proc")
    pid = role_pid(server, "gateway")
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    environment = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0")
                       if "=" in entry)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    if "--listen-fd" in argv:  # cluster up's listening socket, not inherited here: it binds --port itself
        del argv[argv.index("--listen-fd"):argv.index("--listen-fd") + 2]
    flags = ["--enable-force-include-usage", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details"]
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        second = subprocess.Popen([*argv, *flags], env=environment, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        began = time.monotonic()
        while not healthy(url):
            assert second.poll() is None and time.monotonic() - began < 60, log_path.read_text()
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        *body, total = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                                 stream=True, logprobs=1)
        assert [c.usage.completion_tokens for c in body] == [1, 2, 3, 4] and total.choices == []
        assert total.usage.prompt_tokens_details is not None
        assert all(t.startswith("token_id:") for c in body for t in c.choices[0].logprobs.tokens)
        prompt = "The history of the printing press begins " * 8  # several full blocks
        for _ in range(2):  # the second is served from the first's blocks
            usage = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1).usage
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, log_path.read_text()


# -- issue 41: the KV offload tiers behind the API --------------------------------------------


def _long_prompt(index: int) -> str:
    """About 450 tokens: TEXT's paragraphs in another order each time, so no two share a
    block after the chat template's head."""
    paragraphs = TEXT.split("\n\n")
    return "\n\n".join(paragraphs[index:] + paragraphs[:index])[:1900]


def test_a_prompt_pushed_out_of_the_pool_comes_back_from_disk_and_counts_as_cached(server: Server,
                                                                                   client: openai.OpenAI) -> None:
    def chat(prompt: str, max_tokens: int = 8) -> tuple[str, int, int]:
        answer = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0)
        usage = answer.usage
        return answer.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    before = server.metrics()
    text, prompt_tokens, cached = chat(_long_prompt(0))
    for index in range(1, 6):  # 5 x 28 blocks: the first prompt's blocks leave the 128-block pool
        chat(_long_prompt(index), max_tokens=1)
    again, _, cached = chat(_long_prompt(0))
    assert again == text
    assert cached == (prompt_tokens - 1) // 16 * 16  # every full block but the one with the last token
    after = server.metrics()
    loaded = "kvfleet:kv_offload_loaded_blocks_total{medium=DISK}"
    hits = "vllm:external_prefix_cache_hits_total"
    assert 0 < (after[loaded] - before.get(loaded, 0)) * 16 == after[hits] - before.get(hits, 0) <= cached
