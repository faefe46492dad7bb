"""The shapes every tool parser shares: the parsed output, the streamed deltas, and the base
classes that run a format's scanner both one-shot (`parse`) and incrementally (`stream`).

A format only writes a *scanner*: given the not-yet-committed tail of the generated text, it
returns the pieces that are certain (plain text, or whole parsed calls) and how many characters
they used, leaving the rest (a possible partial marker, an unfinished call) for later. `parse`
runs a fresh scanner once with final=True; the streaming parser runs one after every delta with
final=False and once more with final=True in `finish()`. A scanner only commits what more text
could not change, so any chunking of a text streams exactly what `parse` returns for it.

Whitespace: `content` is the text outside the calls, joined and then stripped (None when
nothing is left). The stream sends the same: leading whitespace is dropped, and a whitespace run
is held back until more text follows it, so trailing whitespace is never sent.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ParsedOutput:
    content: str | None  # the text that is not a tool call; None when empty or whitespace-only
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    index: int  # which call (0, 1, ...) of this output
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # a fragment; one index's fragments concatenate to its arguments text


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


Segment = str | ToolCall  # a scanner's output: plain text, or one parsed call


class Scanner(Protocol):
    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        """The certain segments at the start of `text`, and how many characters they used.
        With final=True there is no more text: everything must be used."""
        ...


def new_tool_call_id() -> str:
    """An id for a call in the OpenAI response; the parsers themselves do not need one."""
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_safely(scanner: Scanner, text: str, final: bool) -> tuple[list[Segment], int]:
    # Model output is arbitrary text: a scanner failure must not fail the request. What it
    # cannot place is left for later, and at the end it becomes content.
    try:
        segments, used = scanner.scan(text, final)
    except Exception:
        segments, used = [], 0
    if final and used < len(text):
        segments.append(text[used:])
        used = len(text)
    return segments, used


class StripStream:
    """Streams text as `str.strip` would leave the whole of it (see the module docstring)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        text = self._held + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        self._started = self._started or bool(body)
        return body


class ToolParser(ABC):
    """One subclass per model family's tool-call format."""

    @abstractmethod
    def scanner(self) -> Scanner:
        """A fresh scanner: scanners may keep state between calls, so one per output."""

    def parse(self, text: str) -> ParsedOutput:
        segments, _ = scan_safely(self.scanner(), text, final=True)
        content = "".join(s for s in segments if isinstance(s, str)).strip()
        return ParsedOutput(content or None, [s for s in segments if isinstance(s, ToolCall)])

    def stream(self) -> StreamingToolParser:
        return StreamingToolParser(self.scanner())


class StreamingToolParser:
    """Feeds one output's deltas through a scanner. A call is sent only once it has parsed
    whole: its one delta carries the name and the full arguments, so a call that turns out
    malformed can still become content, as `parse` would make it."""

    def __init__(self, scanner: Scanner) -> None:
        self._scanner = scanner
        self._pending = ""  # text the scanner has not committed yet
        self._calls = 0
        self._content = StripStream()

    def feed(self, delta_text: str) -> StreamDelta:
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        segments, used = scan_safely(self._scanner, self._pending, final)
        self._pending = self._pending[used:]
        delta = StreamDelta()
        for segment in segments:
            if isinstance(segment, ToolCall):
                delta.tool_calls.append(ToolCallDelta(self._calls, segment.name, segment.arguments))
                self._calls += 1
            else:
                delta.content += self._content.push(segment)
        return delta
