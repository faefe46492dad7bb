"""Turn a chat model's generated text into OpenAI tool calls (vLLM's `--tool-call-parser`
formats) and split off its reasoning (`--reasoning-parser`). A leaf library: stdlib only.

    parser = get_tool_parser("hermes")
    parser.parse(text)                 # ParsedOutput(content, tool_calls)
    stream = parser.stream()           # per output: feed(delta) -> StreamDelta, then finish()
"""
from __future__ import annotations

from .base import (
    ParsedOutput,
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    StreamingReasoningParser,
    get_reasoning_parser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: {', '.join(TOOL_PARSERS)}") from None


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeepSeekR1ReasoningParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedOutput",
    "PythonicToolParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "StreamDelta",
    "StreamingReasoningParser",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_reasoning_parser",
    "get_tool_parser",
    "new_tool_call_id",
]
