"""The chat route's reading of a choice's text (gateway/tool_calls.py and the stream's
deltas in gateway/routes/chat.py), on text in real formats: reasoning split off first,
then tool calls by the server's parser ("auto") or by the grammar's shape ("required",
named); streamed in any chunking, it gives what the whole answer gives."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stream_chunks import chunkings

from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest
from gateway.routes.chat import _read
from gateway.tool_calls import ChatOptions, OutputReader, StreamingOutputReader
from gateway.tool_parsers import REASONING_PARSERS, TOOL_PARSERS
from services.cli_args import REASONING_PARSERS as REASONING_FLAG_CHOICES
from services.cli_args import TOOL_CALL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HERMES = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
TEXT = ('Let me check.</think>I will look it up. <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>')


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **fields)


def _streamed(reader: OutputReader, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = StreamingOutputReader(reader)
    reasoning, content, names, arguments = "", "", {}, {}
    for number, piece in enumerate(pieces):
        for message in _read(stream, piece, last=number == len(pieces) - 1):
            reasoning += message.reasoning or ""
            content += message.content or ""
            for call in message.tool_calls or []:
                if call.function.name:
                    assert call.id and call.index not in names, "a call's name comes once, with its id, first"
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return reasoning, content, [(names[i], arguments[i]) for i in sorted(names)]


def test_the_cli_offers_exactly_the_gateways_parsers() -> None:
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(REASONING_FLAG_CHOICES) == set(REASONING_PARSERS)


def test_auto_reads_reasoning_then_calls_whole_and_streamed() -> None:
    reader = OutputReader.of(_request(), HERMES)
    reasoning, parsed = reader.read(TEXT)
    assert reasoning == "Let me check." and parsed.content == "I will look it up."
    calls = [(call.name, call.arguments) for call in parsed.tool_calls]
    assert calls == [("get_weather", json.dumps({"city": "Paris"}))]
    assert reader.tools.finish_reason(bool(parsed.tool_calls), "stop") == "tool_calls"
    for pieces in chunkings(TEXT, seed=5):
        assert _streamed(reader, pieces) == (reasoning, parsed.content, calls)


def test_forced_calls_need_no_parser_and_stream_their_arguments() -> None:
    named = OutputReader.of(_request(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                            ChatOptions())
    assert named.tools.constraint.kind == "json" and named.tools.constraint.field_name == "tool_choice"
    arguments = '{"city": "Oslo"}'
    for pieces in chunkings(arguments, seed=1):
        assert _streamed(named, pieces) == ("", "", [("get_weather", arguments)])
    required = OutputReader.of(_request(tool_choice="required", parallel_tool_calls=False), ChatOptions())
    assert json.loads(required.tools.constraint.spec)["maxItems"] == 1
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    _, parsed = required.read(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Rome"})]
    for pieces in chunkings(text, seed=2):
        assert _streamed(required, pieces)[2] == [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize(("fields", "options"), [
    ({}, ChatOptions()),  # tools default to "auto", which needs the flags
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, ChatOptions()),
])
def test_tool_choice_mistakes_are_400_naming_tool_choice(fields: dict, options: ChatOptions) -> None:
    with pytest.raises(OpenAIError) as raised:
        OutputReader.of(_request(**fields), options)
    assert raised.value.status == 400 and raised.value.param == "tool_choice"


def test_the_grammar_waits_for_reasoning_only_where_the_model_may_think() -> None:
    parser = OutputReader.of(_request(tool_choice="none"), HERMES).reasoning
    assert parser.thinks_after("<|user|>hi<|assistant|><think>\n")  # the template opened it
    assert parser.thinks_after("<|user|>hi<|assistant|>")
    assert not parser.thinks_after("<|user|>hi<|assistant|><think>\n\n</think>\n\n")  # thinking off


def test_auto_tool_choice_without_a_parser_is_refused_at_start() -> None:
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "serve", "--enable-auto-tool-choice"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--tool-call-parser" in done.stderr.splitlines()[-1]
