"""The tool-call parsers (gateway/tool_parsers): each family's real output format, one-shot and
streamed. The streaming invariant: however the text is split into deltas, the streamed content
and calls are exactly what `parse` returns for the whole text."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from stream_chunks import chunkings

from gateway.tool_parsers import (
    TOOL_PARSERS,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
)


def call(name: str, **arguments: object) -> tuple[str, dict]:
    return name, arguments


W = call("get_weather", city="Paris", unit="celsius")
NESTED = {"title": "Café ☕ with Zoë", "attendees": [{"name": "Zoë", "email": "z@x.io"}],
          "options": {"remind": {"minutes": 10}, "private": True, "note": None}, "score": -2.5}
# (parser, generated text, expected content, expected calls as (name, arguments))
CASES: list[tuple[str, str, str | None, list[tuple[str, dict]]]] = [
    # hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [W]),
    ("hermes", "I'll check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>',
     "I'll check both cities.", [call("get_weather", city="Paris"), call("get_weather", city="東京")]),
    ("hermes", f'<tool_call>\n{{"name": "create_event", "arguments": {json.dumps(NESTED)}}}\n</tool_call>',
     None, [("create_event", NESTED)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [call("f", x=1)]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [call("get_time")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n\nDone, see above.',
     "Done, see above.", [call("f", x=1)]),
    ("hermes", 'Calling.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "Calling.", [call("f", x=1)]),  # unterminated
    ("hermes", "The answer is 42.", "The answer is 42.", []),
    ("hermes", "", None, []),
    ("hermes", "  \n ", None, []),
    ("hermes", "if a < b and <tool_c", "if a < b and <tool_c", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # missing brace
     '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', []),
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "argu', 'Sure.<tool_call>\n{"name": "f", "argu', []),  # truncated
    ("hermes", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>',
     "<tool_call>oops</tool_call>", [call("a")]),  # a malformed block stays content; the good one counts
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [W]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [W]),
    ("llama3_json", '\n\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', None, [W]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "ü"}}',
     None, [call("a", x=1), call("b", y="ü")]),
    ("llama3_json", f'{{"name": "create_event", "parameters": {json.dumps(NESTED, ensure_ascii=False)}}}',
     None, [("create_event", NESTED)]),
    ("llama3_json", '{"name": "a", "parameters": {}}\nI called it.', "I called it.", [call("a")]),
    ("llama3_json", '{"name": "a", "parameters": {}};', None, [call("a")]),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "param', '; {"name": "b", "param', [call("a")]),
    ("llama3_json", "<|python", "<|python", []),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [W]),
    ("mistral", 'Let me look that up. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, '
     '{"name": "b", "arguments": {"y": [1, 2]}}]', "Let me look that up.", [call("a", x=1), call("b", y=[1, 2])]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "{\\"q\\": \\"naïve\\"}", "id": "abc123def"}]',
     None, [call("f", q="naïve")]),
    ("mistral", f'[TOOL_CALLS][{{"name": "create_event", "arguments": {json.dumps(NESTED)}}}]',
     None, [("create_event", NESTED)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [W]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', None, [call("a", x=1), call("b")]),
    ("mistral", "See [1] and [2]. [TOOL", "See [1] and [2]. [TOOL", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "argum', '[TOOL_CALLS][{"name": "a", "argum', []),
    ("mistral", "[TOOL_CALLS] hello there", "[TOOL_CALLS] hello there", []),
    ("mistral", "[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', '[TOOL_CALLS]get_weather[ARGS]{"city":', []),  # stripped
    ("mistral", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
    # pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [W]),
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), get_time(tz=\"Europe/Paris\")]",
     None, [W, call("get_time", tz="Europe/Paris")]),
    ("pythonic", "[get_time()]", None, [call("get_time")]),
    ("pythonic", '[f(a=1, b=-2.5, c=True, d=None, e=[1, "two"], g={"k": {"n": 1}}, h="naïve ✓", t=(1, 2))]',
     None, [call("f", a=1, b=-2.5, c=True, d=None, e=[1, "two"], g={"k": {"n": 1}}, h="naïve ✓", t=[1, 2])]),
    ("pythonic", "<|python_start|>[get_weather(city=\"Paris\", unit=\"celsius\")]<|python_end|>", None, [W]),
    ("pythonic", '[\n  f(q="a]b", r=[1, 2]),\n  g(s="""x""")\n]', None, [call("f", q="a]b", r=[1, 2]), call("g", s="x")]),
    ("pythonic", "[f(s=\"a\\\"]b\", t='it\\'s', u=\"\", v='', w=r\"\\d+\")]", None,
     [call("f", s='a"]b', t="it's", u="", v="", w="\\d+")]),
    ("pythonic", "[f()]\nDone.", "Done.", [call("f")]),
    ("pythonic", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("pythonic", "[Paris](https://en.wikipedia.org/wiki/Paris) is nice.",
     "[Paris](https://en.wikipedia.org/wiki/Paris) is nice.", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", "[f(a=g())]", "[f(a=g())]", []),
    ("pythonic", "[f(a={1, 2})]", "[f(a={1, 2})]", []),
    ("pythonic", "[f(**kw)]", "[f(**kw)]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "[f(a=1), 3]", "[f(a=1), 3]", []),
]
IDS = [f"{i}-{name}" for i, (name, *_) in enumerate(CASES)]


def calls_of(output: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in output.tool_calls]


def run_stream(parser: ToolParser, pieces: list[str]) -> ParsedOutput:
    """Reassemble what a client would from the streamed deltas, checking the delta protocol."""
    stream = parser.stream()
    deltas: list[StreamDelta] = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content, names, arguments = "", {}, {}
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            if d.name is not None:
                assert d.index not in names, "a call's name is sent once"
                assert d.index == len(names), "calls are numbered in order"
                names[d.index], arguments[d.index] = d.name, ""
            assert d.index in names, "the name comes first"
            arguments[d.index] += d.arguments
    return ParsedOutput(content or None, [ToolCall(names[i], arguments[i]) for i in range(len(names))])


def assert_streams_like_parse(parser: ToolParser, text: str, seed: int) -> None:
    expected = parser.parse(text)
    for pieces in chunkings(text, seed):
        got = run_stream(parser, pieces)
        assert got.content == expected.content, pieces
        assert calls_of(got) == calls_of(expected), pieces


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_parse(name: str, text: str, content: str | None, calls: list) -> None:
    parsed = get_tool_parser(name).parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    for c in parsed.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=IDS)
def test_stream_matches_parse(name: str, text: str, content: str | None, calls: list) -> None:
    assert_streams_like_parse(get_tool_parser(name), text, seed=len(text))


@pytest.mark.parametrize("name", sorted({name for name, *_ in CASES}))
def test_truncated_outputs_never_raise_and_stream_like_parse(name: str) -> None:
    """Every prefix of every output (a generation cut off by max_tokens or a stop string)."""
    parser = get_tool_parser(name)
    rng = random.Random(name)
    for _, text, *_ in (case for case in CASES if case[0] == name):
        for end in range(len(text) + 1):
            prefix = text[:end]
            expected = parser.parse(prefix)
            pieces = chunkings(prefix, rng.randrange(1 << 30))[rng.randrange(1, 8)]
            got = run_stream(parser, pieces)
            assert (got.content, calls_of(got)) == (expected.content, calls_of(expected)), prefix


def test_stream_sends_content_and_calls_as_soon_as_they_are_certain() -> None:
    stream = get_tool_parser("hermes").stream()
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\nOK'
    sent = []
    for i, ch in enumerate(text):
        delta = stream.feed(ch)
        sent.append((i, delta.content, [(d.name, d.arguments) for d in delta.tool_calls]))
    # The text before the tag goes out before the tag is complete...
    assert "".join(c for i, c, _ in sent if i < text.index("<tool_call>") + 3) == "Let me check."
    # ...and the call on the delta that closes its block, before finish().
    [(i, calls)] = [(i, calls) for i, _, calls in sent if calls]
    assert i == text.index("</tool_call>") + len("</tool_call>") - 1
    assert calls == [("f", '{"x": 1}')]
    assert "".join(c for _, c, _ in sent) + stream.finish().content == "Let me check.\n\nOK"


def test_plain_text_is_not_held_back() -> None:
    for name in ("llama3_json", "pythonic"):
        stream = get_tool_parser(name).stream()
        assert stream.feed("Hello") == StreamDelta("Hello")
        assert stream.feed(", world") == StreamDelta(", world")


def test_pythonic_does_not_rescan_a_long_list() -> None:
    parser = get_tool_parser("pythonic")
    text = "[f(xs=[" + ", ".join(f"[{i}]" for i in range(2000)) + "])]"
    stream = parser.stream()
    for piece in (text[i:i + 4] for i in range(0, len(text), 4)):
        stream.feed(piece)
    assert parser.parse(text).tool_calls[0].name == "f"


def test_hostile_inputs_never_raise() -> None:
    deep = "[" * 100_000
    for name in TOOL_PARSERS:
        parser = get_tool_parser(name)
        for text in (deep, "{" * 100_000, '<tool_call>{"name": "f", "arguments": ' + deep, "[TOOL_CALLS]" + deep,
                     "[f(a=" + deep + ")]", "[f(a=1e999)]", '{"name": "f", "parameters": {"x": NaN}}', "\x00[f()]"):
            parsed = parser.parse(text)
            assert parsed.tool_calls == [] and parsed.content == text.strip()


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name, cls in TOOL_PARSERS.items():
        assert isinstance(get_tool_parser(name), cls)
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*pythonic"):
        get_tool_parser("nope")
    assert new_tool_call_id().startswith("call_") and new_tool_call_id() != new_tool_call_id()


def test_is_a_leaf_library() -> None:
    code = ("import sys, gateway.tool_parsers; bad = [m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'transformers', 'numpy', 'pydantic', 'services', 'kvfleet', 'tokenizer_svc', 'scheduler_svc', "
            "'worker_svc'} or (m.startswith('gateway.') and not m.startswith('gateway.tool_parsers'))]; print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
