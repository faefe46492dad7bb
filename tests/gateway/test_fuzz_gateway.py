"""Property-based fuzzing of the gateway's request bodies (hypothesis), against the real
server: uvicorn over loopback, the engine stepping the real model on its own thread.

Each body mixes valid values with a few wrong-typed or out-of-range ones and unknown
fields. Whatever comes in: never a 5xx, never an error event inside a 200 stream,
every 4xx in OpenAI's error shape naming the field at fault, /health stays 200, a
greedy canary request running alongside keeps its exact output (a bad request never
disturbs its batch), and no KV block stays held at the end. Generation is capped at
2 tokens (no generated body can ask for more), so each case costs one short request.
"""
from __future__ import annotations

import json
import math
import string
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import build_app
from kvfleet.async_engine import AsyncEngine
from scheduler_svc.engine_core import EngineCore
from services.config import EngineConfig
from services.model_source import resolve_model
from tokenizer_svc.in_process import InProcessEncoder
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.runtime.worker import Worker

from conftest import assert_no_leaks
from test_gateway import MODEL, ServerThread, wait_until_idle

CASES = 300  # per endpoint (1,200 bodies a run, each run drawing new ones)
MAX_MODEL_LEN = 256  # small, so that junk lengths reach the context checks
HEALTH_EVERY = 25
VOCAB = 49152
CANARY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}

# Every field has a strategy of valid values and one of bad values: out of range (edges of
# int64 and the vocabulary, non-finite floats) or of the wrong type. A body draws valid
# values, then gives a few fields bad ones, so that most bad values arrive in bodies
# that are otherwise good and reach the check (or the engine) that must catch them.
INT_EDGES = st.sampled_from([2**63, 2**64, 10**30, -(2**63) - 1, -(10**30), 2**63 - 1, 2**31, VOCAB, -1, 0])
FLOAT_EDGES = st.sampled_from([-0.0, 1e-300, 1e308, -1e308, math.nan, math.inf, -math.inf])
WRONG = st.one_of(
    st.none(), st.booleans(), st.text(alphabet=string.ascii_letters, max_size=6), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
BAD_INT = st.one_of(INT_EDGES, INT_EDGES, st.integers(), WRONG)
BAD_FLOAT = st.one_of(FLOAT_EDGES, st.floats(), WRONG)
# Never None (the default) nor a length in [3, MAX_MODEL_LEN): nothing may generate more than 2 tokens.
BAD_LENGTH = st.one_of(INT_EDGES, st.integers(max_value=0), st.integers(min_value=MAX_MODEL_LEN),
                       st.floats(max_value=0), st.floats(min_value=1e6), WRONG.filter(lambda v: v is not None))
TOKEN = st.integers(0, VOCAB - 1)
BAD_TOKENS = st.one_of(st.lists(st.one_of(TOKEN, INT_EDGES, st.integers()), min_size=1, max_size=4), WRONG)
WORD = st.text(min_size=1, max_size=6)
TEXT = st.text(max_size=30)
LENGTH = (st.integers(1, 2), BAD_LENGTH)


def ints(low: int, high: int) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return st.integers(low, high), BAD_INT


def floats(low: float, high: float) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return st.floats(low, high), BAD_FLOAT


def flag() -> tuple[st.SearchStrategy, st.SearchStrategy]:
    return st.booleans(), WRONG


SHARED = {
    "model": (st.just(MODEL), st.one_of(WORD, WRONG)), "n": ints(1, 3), "best_of": ints(1, 4),
    "temperature": floats(0, 2), "top_p": floats(0.01, 1), "top_k": ints(-1, 60), "min_p": floats(0, 1),
    "seed": ints(-(2**63), 2**63 - 1), "stop": (st.one_of(WORD, st.lists(WORD, max_size=3)), st.one_of(
        st.just(""), st.lists(TEXT, min_size=1, max_size=2), WRONG)),
    "stop_token_ids": (st.lists(TOKEN, max_size=3), BAD_TOKENS), "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2), "repetition_penalty": floats(0.01, 2),
    "logit_bias": (st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
                   st.one_of(st.dictionaries(INT_EDGES.map(str), BAD_FLOAT, min_size=1, max_size=2), WRONG)),
    "allowed_token_ids": (st.lists(TOKEN, min_size=1, max_size=5), st.one_of(st.just([]), BAD_TOKENS)),
    "bad_words": (st.lists(WORD, max_size=2), st.one_of(st.lists(TEXT, max_size=2), WRONG)),
    "ignore_eos": flag(), "min_tokens": ints(0, 2), "skip_special_tokens": flag(),
    "spaces_between_special_tokens": flag(), "include_stop_str_in_output": flag(),
    "prompt_logprobs": ints(0, 5), "truncate_prompt_tokens": ints(-1, 40), "cache_salt": (WORD, st.one_of(
        st.just(""), WRONG)), "use_beam_search": flag(), "length_penalty": floats(-2, 2),
    "user": (st.text(max_size=8), WRONG),
}
PROMPT = (st.one_of(TEXT, st.lists(TOKEN, min_size=1, max_size=8), st.lists(TEXT, min_size=1, max_size=3),
                    st.lists(st.lists(TOKEN, min_size=1, max_size=6), min_size=1, max_size=3)),
          st.one_of(BAD_TOKENS, st.lists(BAD_TOKENS, min_size=1, max_size=2), st.just([]), st.just([[]])))
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "developer"]),
    "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
})
MESSAGES = (st.lists(MESSAGE, min_size=1, max_size=3), st.one_of(
    st.just([]), st.lists(st.fixed_dictionaries({"role": WRONG, "content": st.one_of(TEXT, WRONG)}), max_size=2),
    WRONG))
STREAM_OPTIONS = st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})


@st.composite
def bodies(draw: st.DrawFn, required: dict, optional: dict, streams: bool = True) -> dict:
    fields = {**required, **optional}
    if streams:
        fields |= {"stream": flag(), "stream_options": (STREAM_OPTIONS, WRONG)}
    # Mostly one bad field, so that the rest of the body lets it through to its check.
    # Chosen first: hypothesis varies its first choices most evenly.
    num_bad = min(len(fields), draw(st.sampled_from([1, 0, 1, 0, 3])))
    bad = draw(st.lists(st.sampled_from(sorted(fields)), min_size=num_bad, max_size=num_bad, unique=True))
    body = draw(st.fixed_dictionaries({k: v[0] for k, v in required.items()},
                                      optional={k: v[0] for k, v in optional.items()}))
    if streams:  # stream_options only where it is allowed: most bodies should get past that check
        body["stream"] = draw(st.booleans())
        if body["stream"] and draw(st.booleans()):
            body["stream_options"] = draw(STREAM_OPTIONS)
    for name in bad:
        body[name] = draw(fields[name][1])
    unknown = st.text(min_size=1, max_size=8).filter(lambda key: key not in fields)
    body.update(draw(st.dictionaries(unknown, st.one_of(BAD_INT, WRONG), max_size=2)))
    return body


COMPLETIONS = bodies({"prompt": PROMPT, "max_tokens": LENGTH}, {**SHARED, "echo": flag(), "logprobs": ints(0, 5)})
# max_completion_tokens is always there (and wins over max_tokens), so no chat runs to the context's end.
CHAT = bodies({"messages": MESSAGES, "max_completion_tokens": LENGTH}, {
    **SHARED, "max_tokens": LENGTH, "logprobs": flag(), "top_logprobs": ints(0, 5),
    "response_format": (st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}), WRONG),
})
TOKENIZE = bodies({}, {"model": SHARED["model"], "prompt": (TEXT, WRONG), "messages": MESSAGES,
                       "add_special_tokens": flag(), "add_generation_prompt": flag()}, streams=False)
DETOKENIZE = bodies({"tokens": (st.lists(TOKEN, max_size=12), BAD_TOKENS)}, {"model": SHARED["model"]}, streams=False)


class Canary:
    """A greedy request sent again and again alongside the fuzzing; its output must never change."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.outputs: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=60) as http:
            while not self._stop.is_set():
                response = http.post("/v1/completions", json=CANARY)
                self.outputs.append(response.json()["choices"][0]["text"] if response.status_code == 200
                                    else f"HTTP {response.status_code}: {response.text}")

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@dataclass
class Served:
    engine: AsyncEngine
    url: str


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tokenizer = Tokenizer.load(resolve_model(MODEL))
    config = EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 * 2**20)
    core = EngineCore(config, Worker(config))
    engine = AsyncEngine(core)
    engine.start()
    app = build_app(engine, InProcessEncoder(tokenizer), MODEL)
    with ServerThread(app) as server:
        yield Served(engine, server.url)
    engine.shutdown()
    assert_no_leaks(SimpleNamespace(engine=core))


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def check(response: httpx.Response, body: dict) -> None:
    where = f"{response.request.url.path} {json.dumps(body)[:600]} -> {response.status_code} {response.text[:600]}"
    assert response.status_code in (200, 400, 404), where
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], where
        # Bodies are JSON objects here, so every 400 is some field's fault; a 404 is the model's.
        assert error["param"] == "model" if response.status_code == 404 else error["param"], where
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]" and not any('"error"' in e[:12] for e in events[:-1]), where
    else:
        assert response.json(), where


def fuzz(http: httpx.Client, path: str, strategy: st.SearchStrategy[dict]) -> None:
    cases = 0
    expected = http.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]

    @settings(max_examples=CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=strategy)
    def one(body: dict) -> None:
        nonlocal cases
        cases += 1
        # json.dumps writes NaN and Infinity as Python's json module reads them.
        check(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}), body)
        if cases % HEALTH_EVERY == 0:
            assert http.get("/health").status_code == 200, f"unhealthy after {cases} cases"

    with Canary(str(http.base_url)) as canary:
        one()
    assert cases >= CASES
    assert http.get("/health").status_code == 200
    assert canary.outputs and set(canary.outputs) == {expected}, set(canary.outputs)


FUZZED: dict[str, st.SearchStrategy[dict]] = {
    "/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE,
}


@pytest.mark.parametrize("path", list(FUZZED))
def test_fuzzed_bodies_never_break_the_server(http: httpx.Client, served: Served, path: str) -> None:
    fuzz(http, path, FUZZED[path])
    wait_until_idle(served.engine, timeout=5.0)  # every request ended and gave its blocks back
