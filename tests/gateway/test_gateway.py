"""The gateway app in-process: the real model behind a real uvicorn server in a thread,
over an AsyncEngine whose core the tests can reach (inject a failing step, read the
engine's own stats, build an app over an engine that is not running).

These fixtures also serve test_gateway_sampling and test_fuzz_gateway. What only goes
through the OpenAI surface (models, completions, chat, stop strings, errors, auth,
concurrent streams, disconnects, metrics) runs in tests/system/test_openai_modes.py against
both `kvfleet serve` and `kvfleet cluster up` as real processes.
"""
from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from gateway.app import build_app
from gateway.limits import RequestLimits
from gateway.response_options import ResponseOptions
from gateway.tool_calls import ChatOptions
from kvfleet import LLM
from kvfleet.async_engine import AsyncEngine
from kvfleet.run_batch import answer_all
from scheduler_svc.engine_core import EngineCore
from services.config import EngineConfig
from services.messages import EngineStats
from services.model_source import resolve_model
from tokenizer_svc.in_process import InProcessEncoder
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.runtime.worker import Worker

from conftest import assert_no_leaks
from corpus import CHAT, PROMPTS

MODEL = "smollm2"
# Enough KV for one max_model_len request and the sampling tests' batches, a fraction of the default.
KV_CACHE_MEMORY = 512 * 2**20


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
    # It pools too (a --pooler-config): /v1/embeddings shares the chat tests' engine.
    config = EngineConfig(model=MODEL, kv_cache_memory=KV_CACHE_MEMORY, pooler_config='{"pooling_type": "LAST"}')
    core = EngineCore(config, Worker(config))
    engine = AsyncEngine(core)
    engine.start()
    yield Stack(core, engine, tokenizer)
    engine.shutdown()
    # The engine thread has stopped, so the core may be inspected from here.
    assert_no_leaks(SimpleNamespace(engine=core))


def _app(stack: Stack) -> FastAPI:
    return build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL)


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


def wait_until_idle(engine: AsyncEngine, timeout: float = 2.0) -> EngineStats:
    """The engine's stats once nothing runs and no KV block is held, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.num_requests_running == stats.num_requests_waiting == 0 and stats.kv_cache_usage == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine is still busy after {timeout} s: {stats}"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _engine_idle_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        wait_until_idle(request.getfixturevalue("stack").engine)


# -- sampling, failures ----------------------------------------------------------------


def test_logit_bias_and_bad_words_reach_the_sampler(client: openai.OpenAI, stack: Stack) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    first = client.completions.create(**args).choices[0].text
    [first_id] = stack.tokenizer.encode(first, add_special_tokens=False)
    assert client.completions.create(**args, logit_bias={str(first_id): -100}).choices[0].text != first
    assert client.completions.create(**args, extra_body={"bad_words": [first.strip()]}).choices[0].text != first


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
        "max_model_len": stack.core.max_model_len, "token_strs": None,
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
    stopped = AsyncEngine(SimpleNamespace(stats=stack.engine.stats, max_model_len=stack.core.max_model_len,
                                          eos_token_ids=stack.core.eos_token_ids, description=stack.core.description))
    app = build_app(stopped, InProcessEncoder(stack.tokenizer), MODEL)
    with ServerThread(app) as idle:
        assert httpx.get(f"{idle.url}/health").status_code == 503
        response = httpx.post(f"{idle.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert response.status_code == 503 and response.json()["error"]["message"]


def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(stack: Stack) -> None:
    app = build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL, api_key="s3cret")
    with ServerThread(app) as guarded:
        def status(authorization: str) -> int:
            return httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": authorization}).status_code

        assert [status(f"{scheme} s3cret") for scheme in ("Bearer", "bearer", "BEARER")] == [200] * 3
        assert [status(value) for value in ("Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret", "")] == [401] * 5


def _aborted(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    [line] = [m for m in metrics.splitlines() if m.startswith('vllm:request_success_total{finished_reason="abort"')]
    return float(line.rsplit(" ", 1)[1])


def test_every_client_that_leaves_mid_stream_is_counted_as_an_abort(server: ServerThread, stack: Stack) -> None:
    before = _aborted(server.url)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    leaves = 12
    for index in range(leaves):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            if index % 2:  # half leave after the first chunk, half before reading any
                next(response.iter_lines())
    wait_until_idle(stack.engine, timeout=10)
    deadline = time.monotonic() + 5
    while _aborted(server.url) - before < leaves and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server.url) - before == leaves


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "x\udfffy"], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\ud83d"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stop": ["\udc00"]}, "stop"),
])
def test_a_lone_surrogate_is_a_400_and_the_connection_serves_on(server: ServerThread, path, body, param) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as connection:
        raw = json.dumps(body)  # json.dumps writes the surrogate as the escape a client would send
        response = connection.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and "surrogate" in response.json()["error"]["message"]
        again = connection.post("/tokenize", json={"model": MODEL, "prompt": "still served"})
        assert again.status_code == 200 and again.json()["count"] > 0


def test_a_body_over_the_limit_is_413_before_it_is_read(stack: Stack) -> None:
    limits = RequestLimits(max_request_body_bytes=1 << 20)
    with ServerThread(build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL, limits=limits)) as small:
        huge = {"model": MODEL, "prompt": "x" * (2 << 20)}
        declared = httpx.post(f"{small.url}/tokenize", json=huge, timeout=30)
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(4):
                yield b"x" * (1 << 19)
            yield b'"}'

        chunked = httpx.post(f"{small.url}/tokenize", content=chunks(), timeout=30)
        assert chunked.status_code == 413
        assert httpx.post(f"{small.url}/tokenize", json={"prompt": "fits"}).status_code == 200


def test_fan_out_past_the_bound_is_a_400(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": ["a"] * 64, "n": 8, "max_tokens": 1}  # 512 sequences
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert "512 sequences" in response.json()["error"]["message"]
    best_of = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 1, "best_of": 5}, timeout=30)
    assert best_of.status_code == 400 and best_of.json()["error"]["param"] == "best_of"



def _oversized() -> list[tuple[str, dict, str]]:
    """One body per bound of SamplingParams (and the gateway's own), on both routes."""
    bounds = [
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
        ({"allowed_token_ids": [1] * 262_145}, "allowed_token_ids"),
        ({"bad_words": [f"w{i}" for i in range(257)]}, "bad_words"),
        ({"bad_words": ["w" * 257]}, "bad_words"),
        ({"n": 129}, "n"),
        ({"best_of": 129}, "best_of"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        # A port no socket has (gRPC would take it modulo 65536) and a block id no pool has.
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 10**9,
                                 "remote_block_ids": [0]}}, "kv_transfer_params"),
        ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000,
                                 "remote_block_ids": [-5]}}, "kv_transfer_params"),
    ]
    chat_only = [({"top_logprobs": 21, "logprobs": True}, "top_logprobs")]
    cases = [("/v1/completions", {"model": MODEL, "prompt": "Hi", **extra}, param) for extra, param in bounds]
    cases += [("/v1/chat/completions", {"model": MODEL, "messages": CHAT, **extra}, param)
              for extra, param in bounds + chat_only if param != "prompt_logprobs"]
    return cases


def test_requests_past_a_bound_are_400s_naming_the_field_and_a_witness_finishes(server: ServerThread) -> None:
    cases = _oversized()
    assert len(cases) >= 30
    witness_body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 24, "ignore_eos": True, "stream": True}
    witness: list[str] = []

    def stream_witness() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=witness_body, timeout=120) as response:
            witness.extend(line for line in response.iter_lines() if line.startswith("data:"))

    thread = threading.Thread(target=stream_witness)
    thread.start()
    refused = {}
    with httpx.Client(base_url=server.url, timeout=60) as connection:
        for path, body, param in cases:
            response = connection.post(path, json=body)
            refused[(path, param, json.dumps(body)[:60])] = (response.status_code, response.json()["error"]["param"])
    thread.join(120)
    wrong = {case: got for case, got in refused.items() if got != (400, case[1])}
    assert not wrong, wrong
    assert witness[-1] == "data: [DONE]" and len(witness) >= 24  # 24 tokens, then the end
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_prompt_tokens_details_tell_the_cached_prompt_tokens(stack: Stack, client: openai.OpenAI) -> None:
    """--enable-prompt-tokens-details: usage tells how many prompt tokens the prefix cache
    supplied (vLLM's cached_tokens), streamed or not; without it, no details."""
    prompt = "The history of the printing press begins " * 8  # several full blocks
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert plain.usage.prompt_tokens_details is None
    with ServerThread(build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL,
                                options=ResponseOptions(prompt_tokens_details=True))) as detailed:
        again = openai.OpenAI(base_url=f"{detailed.url}/v1", api_key="unused", max_retries=0, timeout=60)
        warm = again.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        block_size = stack.engine.core.config.block_size
        # Every full block but the one holding the last prompt token, which is computed again.
        assert warm.usage.prompt_tokens_details.cached_tokens == (warm.usage.prompt_tokens - 1) // block_size * block_size
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):  # the second is served from the first's blocks
            stream = again.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                   stream_options={"include_usage": True})
            [usage] = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // block_size * block_size


# -- run-batch: batch lines answered by the app itself (gateway/batch.py, kvfleet/run_batch.py)


def _batch_line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_batch_answers_each_line_in_order_as_the_rest_api_does(server: ServerThread) -> None:
    """Every line gets one answer, in the input's order, lines running concurrently up to the
    bound; what the app answers (a completion or an error) is what the same REST request gets."""
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    completion = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "echo": True}
    asked = {  # custom_id: (url, body) of lines the app answers, each also sent as a REST request
        "chat": ("/v1/chat/completions", chat),
        "completion": ("/v1/completions", completion),
        "bad-value": ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
        "no-model": ("/v1/chat/completions", {**chat, "model": "NonExistModel"}),
        "embed": ("/v1/embeddings", {"model": MODEL, "input": "x"}),
    }
    lines = [
        *(_batch_line(custom_id, url, body) for custom_id, (url, body) in asked.items()),
        _batch_line("bad-url", "/bad_url", chat),
        _batch_line("stream", "/v1/chat/completions", {**chat, "stream": "True"}),
        _batch_line("get", "/v1/completions", completion, method="GET"),
        "not json",
        "",  # blank: skipped, as vLLM's runner does
        json.dumps({"method": "POST", "url": "/v1/completions", "body": completion}),
        *(_batch_line(f"more-{i}", "/v1/completions", {"prompt": prompt, "max_tokens": 2}) for i, prompt in
          enumerate(PROMPTS[2:4])),
    ]
    in_flight = peak = 0

    async def counting_app(scope, receive, send) -> None:  # the real app, its concurrency counted
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await server.app(scope, receive, send)
        finally:
            in_flight -= 1

    async def numbered() -> AsyncIterator[tuple[int, str]]:
        for number, text in enumerate(lines, 1):
            if text:
                yield number, text

    sink = io.StringIO()
    malformed = asyncio.run(answer_all(counting_app, numbered(), sink, max_in_flight=3))
    out = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [o["custom_id"] for o in out] == [*asked, "bad-url", "stream", "get", None, None, "more-0", "more-1"]
    assert malformed == [9, 11] and peak == 3
    by_id = {o["custom_id"]: o for o in out if o["custom_id"] is not None}
    for custom_id, (url, body) in asked.items():
        rest = httpx.post(f"{server.url}{url}", json=body, timeout=60)
        answer = by_id[custom_id]
        assert answer["response"]["status_code"] == rest.status_code, custom_id
        if rest.status_code == 200:
            assert answer["error"] is None
            assert _without_ids(answer["response"]["body"]) == _without_ids(rest.json()), custom_id
        else:
            assert answer["response"]["body"] is None and answer["error"] == rest.json(), custom_id
    assert by_id["no-model"]["response"]["status_code"] == 404
    for custom_id, words in [("bad-url", "Supported endpoints: /v1/chat/completions"),
                             ("stream", "must not be sent in stream mode"), ("get", "only POST")]:
        answer = by_id[custom_id]
        assert answer["response"]["status_code"] == 400 and answer["response"]["body"] is None, custom_id
        assert words in answer["error"], answer
    envelope_errors = [o for o in out if o["custom_id"] is None]
    assert [o["response"] for o in envelope_errors] == [None, None]
    assert envelope_errors[0]["error"].startswith("line 9: not JSON")
    assert envelope_errors[1]["error"] == "line 11: custom_id: Field required"


def _without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def test_reasoning_comes_as_reasoning_and_as_reasoning_content(stack: Stack) -> None:
    """--reasoning-parser: the reasoning is `reasoning` (current vLLM's name), also sent as
    `reasoning_content` (its former one), whole and streamed. With deepseek_r1 and no
    </think> in the output, all of it is reasoning."""
    options = ChatOptions(reasoning_parser="deepseek_r1")
    with ServerThread(build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL, chat_options=options)) as app:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}
        whole = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert whole["reasoning"] and whole["reasoning_content"] == whole["reasoning"] and whole["content"] is None
        streamed = httpx.post(f"{app.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        reasoning = [delta for delta in deltas if "reasoning" in delta]
        assert all(delta["reasoning_content"] == delta["reasoning"] for delta in reasoning)
        assert "".join(delta["reasoning"] for delta in reasoning) == whole["reasoning"]


# -- issue 47: the response flags (both modes' request-level tests: tests/system/test_openai_modes.py) --


def test_force_include_usage_and_tokens_as_ids_are_the_server_s_defaults(stack: Stack) -> None:
    """--enable-force-include-usage: every stream tells its usage so far in each chunk and
    whole in a last one, unasked; --return-tokens-as-token-ids: logprobs name tokens
    "token_id:N" unless the request says otherwise."""
    options = ResponseOptions(force_include_usage=True, return_tokens_as_token_ids=True)
    with ServerThread(build_app(stack.engine, InProcessEncoder(stack.tokenizer), MODEL, options=options)) as flagged:
        client = openai.OpenAI(base_url=f"{flagged.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                                stream=True, logprobs=1))
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 4
        assert [c.usage.completion_tokens for c in body] == [1, 2, 3, 4]
        ids = [int(token.removeprefix("token_id:")) for c in body for token in c.choices[0].logprobs.tokens]
        assert stack.tokenizer.decode(ids) == "".join(c.choices[0].text for c in body)
        chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                                   stream=True, logprobs=True))
        assert chat[0].usage.completion_tokens == 0 and chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
        assert all(t.token.startswith("token_id:") for c in chat if c.choices and c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content)
        texts = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": False})
        assert "".join(texts.choices[0].logprobs.tokens) == texts.choices[0].text


def test_logprobs_past_the_default_max_logprobs_of_20_are_refused_in_vllm_s_words(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
    assert refused.value.param == "logprobs"
    assert "Requested sample logprobs of 21, which is greater than max allowed: 20" in refused.value.message
    with pytest.raises(openai.BadRequestError) as whole_vocabulary:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, logprobs=True, top_logprobs=-1)
    assert whole_vocabulary.value.param == "top_logprobs"
    assert "Requested sample logprobs of 49152, which is greater than max allowed: 20" in whole_vocabulary.value.message


def test_embeddings_of_texts_and_token_ids_beside_a_chat_stream(client: openai.OpenAI, stack: Stack) -> None:
    import base64

    import numpy as np

    texts = PROMPTS[:4]
    ids = [stack.tokenizer.encode(text) for text in texts]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True)
    by_text = client.embeddings.create(model=MODEL, input=texts)
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="base64")
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)  # served beside them
    assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in by_text.data] == [0, 1, 2, 3] and by_text.model == MODEL
    for float_data, base64_data in zip(by_text.data, by_ids.data):
        vector = np.array(float_data.embedding)
        assert len(vector) == 576 and abs(np.linalg.norm(vector) - 1) < 1e-5
        # Asked for base64, the client hands the string over: float32 little-endian bytes.
        decoded = np.frombuffer(base64.b64decode(base64_data.embedding), dtype="<f4")
        assert np.allclose(vector, decoded, atol=1e-4)
    [alone] = client.embeddings.create(model=MODEL, input=texts[2]).data
    assert np.dot(alone.embedding, by_text.data[2].embedding) > 0.9999  # the batch changes nothing


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
    ({"input": [1] * 9000}, "input"),  # past the context length
    ({"input": []}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(server: ServerThread, body, param) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or response.json()["error"]["message"])


def test_truncate_prompt_tokens_keeps_an_embedding_s_head(client: openai.OpenAI) -> None:
    long = list(range(100, 9100))
    cut = client.embeddings.create(model=MODEL, input=[long], extra_body={"truncate_prompt_tokens": 12})
    head = client.embeddings.create(model=MODEL, input=[long[:12]])
    assert cut.usage.prompt_tokens == 12
    assert cut.data[0].embedding == pytest.approx(head.data[0].embedding, abs=1e-5)
