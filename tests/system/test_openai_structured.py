"""Structured outputs and tool calls through the official `openai` client, against both
ways of running kvfleet as real process trees (`kvfleet serve`, and `kvfleet cluster
up`), each started once for the module with vLLM's tool flags: twenty JSON schemas by
response_format, regex / choice / grammar on twenty samples at temperature 1.0 by
vLLM's structured_outputs field and its older guided_* fields, and forced tool calls
("required" and named, whole and streamed, then a turn with the result).

These check outputs only, no latencies, so they run beside other tests (unlike
test_openai_modes.py, whose bounds under a second need the machine to themselves).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai_servers import API_KEY, MODES, SERVED, Server, running_server
from structured_schemas import SCHEMAS


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(request.param, tmp_path_factory, *TOOL_FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(autouse=True)
def _idle_after_each_test(server: Server) -> Iterator[None]:
    yield
    server.wait_idle(timeout=10.0)


TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
CLOCK = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": CLOCK}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CONSTRAINTS = {  # field value, and a Python check of each output
    "regex": ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,2}"}, lambda text: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,2}", text)),
    "choice": ({"choice": ["north", "south", "east", "west"]}, lambda text: text in ("north", "south", "east", "west")),
    "grammar": ({"grammar": 'root ::= ("yes" | "no") ", " [a-z]{1,10} "."'},
                lambda text: re.fullmatch(r"(yes|no), [a-z]{1,10}\.", text)),
}



# -- structured outputs and tool calls -------------------------------------------------


def test_twenty_json_schemas_by_response_format(client: openai.OpenAI) -> None:
    def ask(what_and_schema: tuple[str, dict]) -> tuple[str, str | None, str]:
        what, schema = what_and_schema
        response = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": f"Give me {what} as JSON."}], temperature=1.0,
            seed=1, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        choice = response.choices[0]
        return what, choice.message.content, choice.finish_reason

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # together, as one batch in the engine
        answers = list(pool.map(ask, SCHEMAS))
    for (what, content, finish_reason), (_, schema) in zip(answers, SCHEMAS):
        assert finish_reason == "stop", (what, content)
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("spelling", ["structured_outputs", "guided"])
def test_regex_choice_and_grammar_hold_on_twenty_samples(client: openai.OpenAI, kind: str, spelling: str) -> None:
    value, holds = CONSTRAINTS[kind]
    extra = {"structured_outputs": value} if spelling == "structured_outputs" else {f"guided_{kind}": value[kind]}
    response = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": f"Answer with a {kind}."}], n=20, temperature=1.0,
        max_tokens=40, extra_body=extra)
    texts = [choice.message.content for choice in response.choices]
    assert len(texts) == 20 and all(holds(text) for text in texts), texts


def _check_calls(calls: list[tuple[str, str]], only: str | None = None) -> None:
    assert calls
    for name, arguments in calls:
        assert name in SCHEMA_OF and (only is None or name == only), name
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def _streamed_calls(client: openai.OpenAI, **args) -> tuple[list[tuple[str, str]], str]:
    """The calls reassembled from the stream, as an OpenAI client does: by index, the name
    on a call's first delta (with its id), the arguments as fragments after it."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish_reason = ""
    for chunk in client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, stream=True, **args):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    assert call.id and call.index not in names
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish_reason = choice.finish_reason or finish_reason
    return [(names[index], arguments[index]) for index in sorted(names)], finish_reason


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_whole_and_streamed(client: openai.OpenAI, tool_choice: str) -> None:
    only = "get_weather" if tool_choice == "named" else None
    choice = {"type": "function", "function": {"name": only}} if only else "required"
    args = dict(tool_choice=choice, temperature=0.0, max_tokens=120)
    whole = client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, **args).choices[0]
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    _check_calls(calls, only)
    assert whole.finish_reason == ("stop" if only else "tool_calls")
    streamed, finish_reason = _streamed_calls(client, **args)
    assert streamed == calls and finish_reason == whole.finish_reason

    # The second turn: the call and its result go back through the chat template.
    call = whole.message.tool_calls[0]
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model=SERVED, messages=conversation, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=30).choices[0]
    assert answer.message.content and not answer.message.tool_calls


def test_tool_choice_errors_name_the_field(client: openai.OpenAI) -> None:
    for extra in ({"tool_choice": "required"},
                  {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
                  {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=4, extra_body=extra)
        assert caught.value.param in ("tool_choice", "response_format")
