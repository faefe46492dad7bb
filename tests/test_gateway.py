"""The OpenAI-compatible server end to end: the real model behind a real uvicorn server,
driven with the official openai client (and raw HTTP where the shape itself is tested).

One engine serves the module, on its own thread as `kvfleet serve` runs it; two apps
share it (one with an API key). Greedy outputs are checked against the offline SDK.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from conftest import assert_no_leaks
from gateway.app import build_app
from kvfleet import LLM, CompletionOutput, SamplingParams
from services.async_engine import AsyncEngine
from services.config import EngineConfig
from services.engine import EngineCore
from services.messages import EngineStats
from services.model_source import resolve_model
from tokenizer_svc.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
# Enough KV for one max_model_len request and the 32 concurrent streams, a fraction of the default.
KV_CACHE_MEMORY = 512 * 2**20
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The future of AI is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The largest planet in the solar system is",
    "Water boils at",
    "My favourite colour is",
]
CHAT = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass
class Stack:
    core: EngineCore
    engine: AsyncEngine
    tokenizer: Tokenizer


class ServerThread:
    """A uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name TCP, and
        # without it Nagle and delayed ACKs add 40 ms to every response.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tokenizer = Tokenizer.load(resolve_model(MODEL))
    core = EngineCore(EngineConfig(model=MODEL, kv_cache_memory=KV_CACHE_MEMORY), tokenizer.eos_token_id)
    engine = AsyncEngine(core)
    engine.start()
    yield Stack(core, engine, tokenizer)
    engine.shutdown()
    # The engine thread has stopped, so the core may be inspected from here.
    assert_no_leaks(SimpleNamespace(engine=core))


def _app(stack: Stack, api_key: str | None = None) -> FastAPI:
    return build_app(
        stack.engine, stack.tokenizer, MODEL, api_key, max_model_len=stack.core.max_model_len,
        eos_token_ids=stack.core.eos_token_ids,
    )


@pytest.fixture(scope="module")
def server(stack: Stack) -> Iterator[ServerThread]:
    with ServerThread(_app(stack)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The reference: the offline SDK on the same weights."""
    return LLM(MODEL, kv_cache_memory=KV_CACHE_MEMORY)


def sdk_greedy_outputs(llm: LLM, prompt_token_ids: list[list[int]], max_tokens: int) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def sdk_greedy(llm: LLM, prompt_token_ids: list[list[int]], max_tokens: int) -> list[str]:
    return [output.text for output in sdk_greedy_outputs(llm, prompt_token_ids, max_tokens)]


def wait_until_idle(engine: AsyncEngine, timeout: float = 2.0) -> EngineStats:
    """The engine's stats once nothing runs and no KV block is held, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.num_requests_running == stats.num_requests_waiting == 0 and stats.kv_cache_usage == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine is still busy after {timeout} s: {stats}"
        time.sleep(0.02)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name{label=value,...}` without model_name."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.fixture(autouse=True)
def _engine_idle_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        wait_until_idle(request.getfixturevalue("stack").engine)


# -- models, completions -----------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, stack: Stack) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == stack.core.max_model_len


def test_completion_matches_the_offline_sdk(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = PROMPTS[0]
    ids = stack.tokenizer.encode(prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    [choice] = response.choices
    assert choice.text == sdk_greedy(llm, [ids], 12)[0]
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 12)
    assert response.usage.total_tokens == len(ids) + 12


def test_batches_of_texts_and_token_ids(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    texts = PROMPTS[:3]
    ids = [stack.tokenizer.encode(text) for text in texts]
    expected = sdk_greedy(llm, ids, 8)
    for prompt in (texts, ids):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [c.text for c in response.choices] == expected
        assert response.usage.prompt_tokens == sum(map(len, ids))
        assert response.usage.completion_tokens == 3 * 8
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[1]


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text


def test_completion_logprobs_in_the_legacy_format(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert top[token] == logprob == max(top.values())


def test_streamed_completion_with_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


# -- chat ------------------------------------------------------------------------------


def test_chat_streaming_and_whole_give_the_same_tokens(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    args = dict(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))

    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant"
    expected = sdk_greedy(llm, [stack.tokenizer.apply_chat_template(CHAT)], 16)[0]
    assert message.content == expected

    first, *content, final, usage = chunks
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in content) == message.content
    assert all(c.choices[0].finish_reason is None for c in [first, *content])
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.choices[0].delta.content is None
    streamed_tokens = [t.token for c in content for t in c.choices[0].logprobs.content]
    assert streamed_tokens == [t.token for t in whole.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    assert usage.choices == [] and usage.usage == whole.usage
    assert whole.usage.completion_tokens == len(streamed_tokens)
    assert whole.usage.prompt_tokens == len(stack.tokenizer.apply_chat_template(CHAT))


def test_logit_bias_and_bad_words_reach_the_sampler(client: openai.OpenAI, stack: Stack) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    first = client.completions.create(**args).choices[0].text
    [first_id] = stack.tokenizer.encode(first, add_special_tokens=False)
    assert client.completions.create(**args, logit_bias={str(first_id): -100}).choices[0].text != first
    assert client.completions.create(**args, extra_body={"bad_words": [first.strip()]}).choices[0].text != first


def test_chat_raw_sse_format(server: ServerThread) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"delta":{"role":"assistant","content":""}' in lines[0]
    assert '"delta":{},"logprobs":null,"finish_reason":"length"' in lines[-2]


def _stop_string_case(client: openai.OpenAI, straddle: bool) -> tuple[dict, str, str]:
    """(request args, a stop string, the text before it) from a greedy run. The stop
    string starts on a token boundary, or (straddle) one character before it."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    free = client.chat.completions.create(**args, logprobs=True).choices[0]
    tokens = [t.token for t in free.logprobs.content]
    k = len(tokens) // 2
    start = len("".join(tokens[:k])) - straddle
    stop = free.message.content[start : start + 3]
    assert free.message.content.index(stop) == start and stop.strip(), (stop, free.message.content)
    return args, stop, free.message.content[:start]


def test_stop_strings_end_the_text_and_free_the_request(client: openai.OpenAI, stack: Stack) -> None:
    args, stop, cut = _stop_string_case(client, straddle=False)
    whole = client.chat.completions.create(**args, stop=[stop])
    assert whole.choices[0].message.content == cut
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.chat.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The engine knows nothing of stop strings: the gateway aborted the request.
    wait_until_idle(stack.engine)


def test_a_stop_string_that_starts_in_an_earlier_delta(client: openai.OpenAI) -> None:
    args, stop, cut = _stop_string_case(client, straddle=True)
    assert client.chat.completions.create(**args, stop=[stop]).choices[0].message.content == cut


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"10000000": 5}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_field(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=extra)
    assert caught.value.param == param and caught.value.message


def test_missing_messages_and_bad_prompts_are_400(server: ServerThread, client: openai.OpenAI) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[], max_tokens=4)
    assert caught.value.param == "prompt"
    not_json = httpx.post(f"{server.url}/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "error" in not_json.json()


def test_a_bad_prompt_in_a_batch_rejects_the_whole_batch(client: openai.OpenAI, stack: Stack) -> None:
    good = stack.tokenizer.encode(PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt=[good, [10**9]], max_tokens=4000, extra_body={"ignore_eos": True}
        )
    assert caught.value.param == "prompt" and str(10**9) in caught.value.message
    # The good prompt's request was aborted with the batch, not left generating.
    wait_until_idle(stack.engine)


def test_too_long_prompt_states_both_lengths(client: openai.OpenAI, stack: Stack) -> None:
    limit = stack.core.max_model_len
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[1] * (limit + 1), max_tokens=4)
    assert caught.value.param == "prompt"
    assert str(limit + 1) in caught.value.message and str(limit) in caught.value.message.replace(str(limit + 1), "")


def test_unknown_model_and_route_are_404(client: openai.OpenAI, server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert caught.value.param == "model"
    response = httpx.get(f"{server.url}/v1/no-such-route")
    assert response.status_code == 404 and "error" in response.json()


# -- auth ------------------------------------------------------------------------------


def test_api_key_guards_v1_but_not_health(stack: Stack) -> None:
    with ServerThread(_app(stack, api_key="s3cret")) as guarded:
        wrong = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        anonymous = httpx.post(f"{guarded.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{guarded.url}/health").status_code == 200
        right = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list().data] == [MODEL]
        assert right.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


# -- concurrency, disconnects, metrics ---------------------------------------------------


def test_32_concurrent_streams_match_the_offline_sdk(server: ServerThread, stack: Stack, llm: LLM) -> None:
    prompts = PROMPTS * 4
    outputs = sdk_greedy_outputs(llm, [stack.tokenizer.encode(p) for p in PROMPTS], 12)
    expected = {prompt: (output.text, output.finish_reason) for prompt, output in zip(PROMPTS, outputs)}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    assert asyncio.run(run()) == [expected[p] for p in prompts]


def test_disconnect_mid_stream_aborts_the_request(server: ServerThread, stack: Stack) -> None:
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client() as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == "" and next(lines).startswith("data: ")
        assert stack.engine.stats().num_requests_running == 1
    # Leaving the block closed the connection mid-stream.
    stats = wait_until_idle(stack.engine, timeout=2.0)
    assert stats.kv_cache_usage == 0
    after = scrape(server.url)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:request_success_total{finished_reason=abort}"] == before[
        "vllm:request_success_total{finished_reason=abort}"] + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts(server: ServerThread, stack: Stack) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    wait_until_idle(stack.engine, timeout=2.0)


def test_metrics_use_vllm_names(client: openai.OpenAI, server: ServerThread, stack: Stack) -> None:
    before = scrape(server.url)
    client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=5, temperature=0)
    after = scrape(server.url)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[gauge] == 0
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in after
    grew = {
        "vllm:generation_tokens_total": 5,
        "vllm:prompt_tokens_total": len(stack.tokenizer.encode(PROMPTS[4])),
        "vllm:request_success_total{finished_reason=length}": 1,
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:inter_token_latency_seconds_count": 4,
        "vllm:e2e_request_latency_seconds_count": 1,
    }
    assert {name: after[name] - before[name] for name in grew} == grew
    assert not any(name.endswith("_created") for name in after)


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(
    client: openai.OpenAI, stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = stack.core.worker
    execute = worker.execute
    calls = 0

    def fail_third_step(plan):  # after the real step ran: the worst case for consistency
        nonlocal calls
        result = execute(plan)
        calls += 1
        if calls == 3:
            raise RuntimeError("injected worker failure")
        return result

    monkeypatch.setattr(worker, "execute", fail_third_step)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True)
    with pytest.raises(openai.APIError, match="injected worker failure"):
        list(stream)
    wait_until_idle(stack.engine)
    monkeypatch.undo()
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert again.usage.completion_tokens == 4


# -- tokenizer endpoints, health -------------------------------------------------------


def test_tokenize_and_detokenize(server: ServerThread, stack: Stack) -> None:
    tokenizer = stack.tokenizer
    text = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    assert text == {
        "tokens": tokenizer.encode(PROMPTS[0]), "count": len(tokenizer.encode(PROMPTS[0])),
        "max_model_len": stack.core.max_model_len,
    }
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": text["tokens"]}).json()
    assert back == {"prompt": PROMPTS[0]}
    neither = httpx.post(f"{server.url}/tokenize", json={})
    assert neither.status_code == 400


def test_health_and_version(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_an_engine_that_is_not_running_is_503(stack: Stack) -> None:
    # Never started, so it never calls its core beyond the first stats().
    stopped = AsyncEngine(SimpleNamespace(stats=stack.engine.stats))
    app = build_app(stopped, stack.tokenizer, MODEL, max_model_len=stack.core.max_model_len)
    with ServerThread(app) as idle:
        assert httpx.get(f"{idle.url}/health").status_code == 503
        response = httpx.post(f"{idle.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert response.status_code == 503 and response.json()["error"]["message"]


# -- the command line ------------------------------------------------------------------


def test_kvfleet_serve_command(stack: Stack) -> None:
    """`kvfleet serve` as a user runs it: positional model, vLLM flags, a served name."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "kvfleet.cli", "serve", MODEL, "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", "256", "--kv-cache-memory", str(64 * 2**20),
    ]
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "KVFLEET_API_KEY": "k"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "kvfleet serve did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.models.list().data[0].model_extra["max_model_len"] == 256
        response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert response.usage.completion_tokens == 4
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
