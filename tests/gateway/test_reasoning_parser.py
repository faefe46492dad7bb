"""The reasoning parsers (gateway/tool_parsers/reasoning.py): `<think>...</think>` split off as
reasoning_content, one-shot and streamed; any split of the text into deltas streams exactly
what `parse` returns for the whole."""
from __future__ import annotations

import random

import pytest
from stream_chunks import chunkings

from gateway.tool_parsers import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

CASES: list[tuple[str, str, str | None, str | None]] = [
    # deepseek_r1: the opening tag may be in the prompt, so everything before </think> is reasoning
    ("deepseek_r1", "<think>\nLet me think: 2 + 2.\n</think>\n\nThe answer is 4.",
     "Let me think: 2 + 2.", "The answer is 4."),
    ("deepseek_r1", "Let me think: 2 + 2.\n</think>\n\nThe answer is 4.", "Let me think: 2 + 2.", "The answer is 4."),
    ("deepseek_r1", "\n<think>思考中… ünïcode</think>答案是 4。", "思考中… ünïcode", "答案是 4。"),
    ("deepseek_r1", "Still thinking about it", "Still thinking about it", None),  # no </think>: all reasoning
    ("deepseek_r1", "<think>Still going, cut off by max_tok", "Still going, cut off by max_tok", None),
    ("deepseek_r1", "<think>\n\n</think>\n\nHi!", None, "Hi!"),
    ("deepseek_r1", "<think>a</think>b <think> c </think> d", "a", "b <think> c </think> d"),
    ("deepseek_r1", "<think>x < y and </thin", "x < y and </thin", None),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "<thi", "<thi", None),
    # qwen3: reasoning only when <think> opens the output
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    ("qwen3", "Hello!", None, "Hello!"),
    ("qwen3", "Hello </think> there", None, "Hello </think> there"),
    ("qwen3", "Text then <think>not reasoning</think>", None, "Text then <think>not reasoning</think>"),
    ("qwen3", "  \n<think>x</think>\ny", "x", "y"),
    ("qwen3", "<think>unterminated", "unterminated", None),
    ("qwen3", "<think>\n\n</think>\n\n", None, None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, None),
]
IDS = [f"{i}-{name}" for i, (name, *_) in enumerate(CASES)]


def run_stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream()
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        assert not (content and r), "no reasoning after content began"
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("name,text,reasoning,content", CASES, ids=IDS)
def test_parse(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert get_reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES, ids=IDS)
def test_stream_matches_parse(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    parser = get_reasoning_parser(name)
    for pieces in chunkings(text, seed=len(text)):
        assert run_stream(parser, pieces) == (reasoning, content), pieces


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_truncated_outputs_stream_like_parse(name: str) -> None:
    parser = get_reasoning_parser(name)
    rng = random.Random(name)
    for _, text, *_ in (case for case in CASES if case[0] == name):
        for end in range(len(text) + 1):
            pieces = chunkings(text[:end], rng.randrange(1 << 30))[rng.randrange(1, 8)]
            assert run_stream(parser, pieces) == parser.parse(text[:end]), text[:end]


def test_reasoning_streams_before_the_end_tag_and_reports_when_it_ends() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<think>") == ("", "") and not stream.reasoning_ended
    assert stream.feed("Step one.") == ("Step one.", "")
    assert stream.feed(" Done</th") == (" Done", "") and not stream.reasoning_ended  # a partial tag is held
    assert stream.feed("ink>\n\nFour") == ("", "Four") and stream.reasoning_ended
    assert stream.finish() == ("", "")

    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("\n<th") == ("", "") and not stream.reasoning_ended
    assert stream.feed("ey said") == ("", "<they said") and stream.reasoning_ended


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")
