"""The OpenAI API through the official `openai` client, against both ways of running
kvfleet as real process trees: `kvfleet serve` (embedded: one process) and
`kvfleet cluster up` (nats-server, Redis and every role as its own process).

Each mode starts once for the module, on a free port with an API key, and every test
runs against both: models; completions single, batched, echoed, with logprobs,
streamed; chat, whose streamed and whole answers are identical; stop strings; usage;
bad input and auth errors; 32 concurrent streams; a client that leaves (mid-stream,
or before a whole answer) frees its request and every KV block within 2 s, as the
server's own /metrics says. Every greedy output is checked against the offline SDK on
the same weights, and the last test checks that both modes gave identical outputs.

The fixture also checks that `cluster up` runs every part as its own process, and
that SIGTERM stops either mode with exit code 0 and no process left behind. A failed
test shows the tail of the server's log (tests/conftest.py).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet import LLM, SamplingParams
from kvfleet.processes import free_port
from services.outputs import CompletionOutput

from corpus import CHAT, PROMPTS

# Latency bounds under a second: run alone (see pyproject's markers).
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
MODES = ("serve", "cluster")
MODEL = "smollm2"
SERVED = "smol"  # --served-model-name: what clients must send
API_KEY = "sesame"
MAX_MODEL_LEN = 512
# 32 streams of a short prompt and 12 tokens hold 2 blocks each; a long request 32.
NUM_BLOCKS = 128
ENGINE_FLAGS = [
    "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(NUM_BLOCKS),
]
START_TIMEOUT_S = 180.0
PROC = sys.platform.startswith("linux")  # the process tree is read from /proc
# The cluster gateway's gauges come from a poller (every 0.5 s): a reading counts as
# "after" an event only once a poll that began after the event has landed.
STATS_LAG_S = {"serve": 0.0, "cluster": 0.8}
IDLE_WITHIN_S = 2.0

# Greedy outputs by mode (and the SDK's), for the cross-mode test at the end.
GREEDY: dict[str, dict[str, Any]] = {"sdk": {}, **{mode: {} for mode in MODES}}


# -- the servers -------------------------------------------------------------------------


@dataclass
class Server:
    mode: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 8000) -> str:
        """What conftest's report hook shows under a failed test."""
        text = self.log_path.read_text(errors="replace")
        return f"[kvfleet {self.mode}, exit code {self.process.poll()}] ...\n{text[-chars:]}"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (open without the key), keyed `name{label=value,...}` without model_name."""
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def wait_idle(self, since: float | None = None, timeout: float = IDLE_WITHIN_S) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is held, within `timeout`
        of `since` (a time.monotonic(); default now). With `since`, only a reading of the
        engine's state after that moment counts."""
        start = time.monotonic() if since is None else since
        fresh = start + (STATS_LAG_S[self.mode] if since is not None else 0.0)
        while True:
            now = time.monotonic()
            metrics = self.metrics()
            busy = {name: metrics[name] for name in
                    ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
            if now >= fresh and not any(busy.values()):
                return metrics
            assert now < start + timeout, f"{self.mode}: still busy {now - start:.2f} s later: {busy}"
            time.sleep(0.05)

    def wait_for(self, condition: Callable[[dict[str, float]], bool], timeout: float = 5.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while not condition(metrics := self.metrics()):
            assert time.monotonic() < deadline, f"{self.mode}: /metrics never got there: {metrics}"
            time.sleep(0.05)
        return metrics


def _command(mode: str, port: int) -> list[str]:
    common = [*ENGINE_FLAGS, "--port", str(port), "--api-key", API_KEY, "--served-model-name", SERVED]
    if mode == "serve":  # vLLM's form: the model positional
        return [sys.executable, "-m", "kvfleet.cli", "serve", MODEL, *common]
    return [sys.executable, "-m", "kvfleet.cli", "cluster", "up", "--model", MODEL, *common, "--lease-ttl", "3"]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    mode = request.param
    port = free_port()
    log_path = tmp_path_factory.mktemp(f"kvfleet-{mode}") / "server.log"
    env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
    env.update(KVFLEET_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:  # O_APPEND: the children write, the tests read
        process = subprocess.Popen(_command(mode, port), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    running = Server(mode, f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(running.url):
            assert process.poll() is None, f"kvfleet {mode} exited while starting\n{running.log_tail()}"
            assert time.monotonic() < deadline, (
                f"kvfleet {mode} not healthy in {START_TIMEOUT_S} s\n{running.log_tail()}")
            time.sleep(0.25)
        children = descendants(process.pid) if PROC else set()
        if mode == "cluster" and PROC:  # nats, redis, tokenizer, worker, scheduler, gateway
            assert len(children) >= 6, f"{children}\n{running.log_tail()}"
        yield running
        # SIGTERM stops both cleanly; the cluster launcher stops its roles, then NATS and Redis.
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=90)
        assert code == 0, f"kvfleet {mode} exited with {code} on SIGTERM\n{running.log_tail()}"
        assert not [pid for pid in children if alive(pid)], f"left running\n{running.log_tail()}"
        if mode == "cluster":
            assert "cluster stopped" in running.log_tail()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


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

    first, *content, final, usage = chunks
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    streamed = "".join(c.choices[0].delta.content for c in content)
    record(server, "chat streamed", streamed, expected.text)
    assert all(c.choices[0].finish_reason is None for c in [first, *content])
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.choices[0].delta.content is None
    streamed_tokens = [t.token for c in content for t in c.choices[0].logprobs.content]
    assert streamed_tokens == [t.token for t in whole.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    assert usage.choices == [] and usage.usage == whole.usage
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
    assert '"delta":{},"logprobs":null,"finish_reason":"length"' in lines[-2]


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
        ({"response_format": {"type": "json_object"}}, "response_format"),
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


@pytest.mark.xfail(reason="issue 18 item 7, not met yet: serve's slowest /health was ~0.65 s (the tokenizers "
                          "library frees a 3.2M-token Encoding in 0.55 s with the GIL held), cluster's ~0.15 s")
def test_a_five_megabyte_prompt_never_stalls_health(server: Server) -> None:
    """Parsing, checking and tokenizing a 5 MB prompt (seconds of work) happen off the
    gateway's event loop: /health keeps answering within 100 ms all along."""
    rng = random.Random(5)
    words = [f"{rng.choice('bcdfghjklmnprstvw')}{rng.choice('aeiou')}{rng.choice('nrst')}{i}" for i in range(2000)]
    prompt = " ".join(rng.choice(words) for _ in range(5_000_000 // 7))[:5_000_000]
    answer: dict[str, httpx.Response] = {}

    def tokenize() -> None:
        answer["r"] = httpx.post(f"{server.url}/tokenize", json={"model": SERVED, "prompt": prompt},
                                 headers=bearer(), timeout=120)

    worker = threading.Thread(target=tokenize)
    latencies = []
    with httpx.Client(timeout=10) as health:
        worker.start()
        while worker.is_alive():
            began = time.perf_counter()
            assert health.get(f"{server.url}/health").status_code == 200
            latencies.append(time.perf_counter() - began)
            time.sleep(0.02)
    worker.join()
    assert answer["r"].status_code == 200 and answer["r"].json()["count"] > 500_000, answer["r"].text[:300]
    assert len(latencies) > 10 and max(latencies) < 0.1, f"{server.mode}: slowest /health {max(latencies):.3f} s"


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


def test_a_client_that_leaves_mid_stream_frees_its_request_within_2_s(
    server: Server, client: openai.OpenAI, llm: LLM
) -> None:
    before = server.metrics()
    ids = encode(llm, PROMPTS[0])
    stream = client.completions.create(
        model=SERVED, prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN - len(ids), temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        chunks = iter(stream)
        assert next(chunks).choices[0].text is not None
        # The server sees it running (in cluster mode, once the gateway's poller has).
        server.wait_for(lambda m: m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0)
        assert next(chunks).choices[0].finish_reason is None  # still streaming
    finally:
        stream.close()  # the client leaves: its connection closes mid-stream
    left = time.monotonic()
    after = server.wait_idle(since=left)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    grew = {reason: after[f"vllm:request_success_total{{finished_reason={reason}}}"]
            - before[f"vllm:request_success_total{{finished_reason={reason}}}"] for reason in ("abort", "length")}
    assert grew == {"abort": 1, "length": 0}


def test_a_client_that_leaves_before_a_whole_answer_frees_its_request(server: Server, llm: LLM) -> None:
    before = server.metrics()
    ids = encode(llm, PROMPTS[1])
    body = {"model": SERVED, "prompt": PROMPTS[1], "max_tokens": MAX_MODEL_LEN - len(ids), "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=bearer(), timeout=1.0)
    after = server.wait_idle(since=time.monotonic())
    assert after["vllm:request_success_total{finished_reason=abort}"] == \
        before["vllm:request_success_total{finished_reason=abort}"] + 1


def test_metrics_use_vllm_names(server: Server, client: openai.OpenAI, llm: LLM) -> None:
    before = server.metrics()
    client.completions.create(model=SERVED, prompt=PROMPTS[4], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.wait_idle(since=time.monotonic())
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in after
    grew = {
        "vllm:generation_tokens_total": 5,
        "vllm:prompt_tokens_total": len(encode(llm, PROMPTS[4])),
        "vllm:request_success_total{finished_reason=length}": 1,
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:inter_token_latency_seconds_count": 4,
        "vllm:e2e_request_latency_seconds_count": 1,
    }
    assert {name: after[name] - before[name] for name in grew} == grew
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
    while _healthy(server.url):  # its lease lapses
        assert time.monotonic() - began < 30, server.log_tail()
        time.sleep(0.2)
    while not _healthy(server.url):  # restarted after its backoff, loaded, and taken up: no cluster restart
        assert time.monotonic() - began < START_TIMEOUT_S, server.log_tail()
        time.sleep(0.25)
    reply = client.completions.create(model=SERVED, prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    assert server.process.poll() is None and role_pid(server, "worker") != killed
    assert "worker exited with code -9; restarting it" in server.log_tail()


# -- across the modes ---------------------------------------------------------------------------


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
