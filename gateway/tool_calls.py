"""Tool calling in chat completions, as vLLM serves it.

`tool_choice` is checked against the tools and the server's flags: "auto" needs
`--enable-auto-tool-choice` and `--tool-call-parser`, whose parser then reads the
model's text; "required" and a named function need no parser, because a grammar
built from the tools' schemas makes the model write exactly the calls (so even a
small model returns valid ones): a JSON list of {"name", "parameters"} for
"required", the named function's arguments object for a named choice. As vLLM, a
forced call answers with content "", and one cut short (by max_tokens) is no call at
all. With `--reasoning-parser`, the reasoning is split off first and the rest is read
for calls.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.protocol import ChatCompletionRequest, NamedToolChoice
from gateway.tool_parsers import (
    ParsedOutput,
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
)
from gateway.tool_parsers.reasoning import ReasoningParser, StreamingReasoningParser
from services.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatOptions:
        return cls(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


@dataclass(frozen=True)
class ToolCalling:
    """One chat request's tool policy."""

    choice: str  # "auto", "required" or "named"
    tools: list[dict[str, Any]]  # each tool's function: name, description, parameters
    parallel: bool
    parser: ToolParser | None  # "auto" only
    named: str | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest, options: ChatOptions) -> ToolCalling | None:
        """None when no calls can come back (no tools, or tool_choice "none"). Bad
        combinations are 400s naming the field, as vLLM answers them."""
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if choice == "none":
            return None
        if not body.tools:
            raise bad_request("tool_choice", f"tool_choice {_name(choice)!r} needs tools")
        tools = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool["name"] for tool in tools}:
                raise bad_request("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
            return cls("named", tools, body.parallel_tool_calls, None, choice.function.name)
        if choice == "auto":
            if not options.auto_tools:
                raise bad_request("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set")
            return cls("auto", tools, body.parallel_tool_calls, get_tool_parser(options.tool_call_parser))
        return cls("required", tools, body.parallel_tool_calls, None)

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.named)), field_name="tool_choice")
        if self.choice == "required":
            return StructuredOutputsParams(json=_required_calls(self.tools, self.parallel), field_name="tool_choice")
        return None

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """A choice's finish reason once it has (or has not) `called` a tool. As OpenAI:
        calls the model chose (auto, required) end with "tool_calls"; a named one with "stop"."""
        return "tool_calls" if called and reason == "stop" and self.choice != "named" else reason

    def parse(self, text: str) -> ParsedOutput:
        if self.parser is not None:
            return self.parser.parse(text)
        try:
            value = json.loads(text)  # whole, as its grammar closes it
        except ValueError:  # cut short by max_tokens: no call
            return ParsedOutput("")
        if self.choice == "named":  # the arguments as written, as they were streamed
            return ParsedOutput("", [ToolCall(self.named, text)])
        return ParsedOutput("", [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                                 for call in value])

    def stream(self) -> StreamingToolParser:
        if self.parser is not None:
            return self.parser.stream()
        if self.choice == "named":
            return _NamedCallStream(self.named)
        return _WholeOutputStream(self)

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(tool for tool in self.tools if tool["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object"}


def _required_calls(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a "required" answer: a list of calls, each one tool's name and
    arguments. A tool's `$defs` move to the list's root, where its `#/$defs/...`
    references now point; two tools defining one name differently are a 400, as in vLLM."""
    defs: dict[str, Any] = {}
    choices = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        defined = parameters.pop("$defs", {})
        if not isinstance(defined, dict):
            raise bad_request("tools", f"the $defs of tool {tool['name']!r} must be an object")
        for name, schema in defined.items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request("tools", f"Tool definition '{name}' has multiple schemas, which is not supported.")
        choices.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["name"]]},
                                                         "parameters": parameters},
                        "required": ["name", "parameters"]})
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel:
        calls["maxItems"] = 1
    if defs:
        calls["$defs"] = defs
    return calls


def _name(choice: object) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else str(choice)


class _NamedCallStream(StreamingToolParser):
    """The output is the named function's arguments: each delta is a fragment of them."""

    def __init__(self, name: str) -> None:
        self._name: str | None = name

    def feed(self, delta_text: str) -> StreamDelta:
        if not delta_text and self._name is None:
            return StreamDelta()
        name, self._name = self._name, None
        return StreamDelta(tool_calls=[ToolCallDelta(0, name, delta_text)])

    def finish(self) -> StreamDelta:
        return self.feed("")


class _WholeOutputStream(StreamingToolParser):
    """A "required" list of calls, sent once the grammar has closed it."""

    def __init__(self, calling: ToolCalling) -> None:
        self._calling = calling
        self._text: list[str] = []

    def feed(self, delta_text: str) -> StreamDelta:
        self._text.append(delta_text)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        parsed = self._calling.parse("".join(self._text))
        return StreamDelta(parsed.content or "", [ToolCallDelta(index, call.name, call.arguments)
                                                  for index, call in enumerate(parsed.tool_calls)])


@dataclass(frozen=True)
class OutputReader:
    """Reads one choice's text: reasoning first (with --reasoning-parser), then tool calls."""

    reasoning: ReasoningParser | None
    tools: ToolCalling | None

    @classmethod
    def of(cls, body: ChatCompletionRequest, options: ChatOptions) -> OutputReader:
        reasoning = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
        return cls(reasoning, ToolCalling.of(body, options))

    def read(self, text: str) -> tuple[str | None, ParsedOutput]:
        """(reasoning, the rest as content and tool calls)."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        if self.tools is None:
            return reasoning, ParsedOutput(content)
        return reasoning, self.tools.parse(content or "")


class StreamingOutputReader:
    """OutputReader, delta by delta: each feed gives (reasoning delta, content and call deltas)."""

    def __init__(self, reader: OutputReader) -> None:
        self._reasoning: StreamingReasoningParser | None = reader.reasoning.stream() if reader.reasoning else None
        self._tools: StreamingToolParser | None = reader.tools.stream() if reader.tools else None

    def feed(self, delta_text: str) -> tuple[str, StreamDelta]:
        reasoning, content = self._reasoning.feed(delta_text) if self._reasoning else ("", delta_text)
        return reasoning, self._tools.feed(content) if self._tools else StreamDelta(content)

    def finish(self) -> tuple[str, StreamDelta]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        if self._tools is None:
            return reasoning, StreamDelta(content)
        fed = self._tools.feed(content)
        done = self._tools.finish()
        return reasoning, StreamDelta(fed.content + done.content, fed.tool_calls + done.tool_calls)
