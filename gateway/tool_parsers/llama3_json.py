"""`llama3_json`: Llama 3.1/3.2 JSON tool calling. The whole output is the call(s): JSON objects
`{"name": ..., "parameters": {...}}` ("arguments" also accepted) separated by `;`, optionally
after the `<|python_tag|>` token:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not open with `{` (after the tag and whitespace) is plain content, and so
is one whose first object is not a call. Text after the last call is content.
"""
from __future__ import annotations

from .base import Scanner, Segment, ToolParser
from .common import call_from_object, decode_json, skip_ws, starts_with

PYTHON_TAG = "<|python_tag|>"


class _Llama3Scanner:
    def __init__(self) -> None:
        # "start": nothing decided yet; "calls": after a call, before a `;` or the end;
        # "content": the rest of the output is plain text.
        self._state = "start"

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        out: list[Segment] = []
        pos = 0  # where the uncommitted text starts: what becomes content if no call follows
        while self._state != "content":
            if self._state == "start":
                start = skip_ws(text, pos)
                tag = starts_with(text, start, PYTHON_TAG)
                if tag is None and not final:
                    return out, pos
                if tag:
                    start = skip_ws(text, start + len(PYTHON_TAG))
            else:
                start = skip_ws(text, pos)
                if start < len(text) and text[start] == ";":
                    start = skip_ws(text, start + 1)
                elif start < len(text):
                    break  # something other than a separator follows the calls
            if start == len(text):
                if not final:
                    return out, pos
                if self._state == "calls":
                    return out, len(text)  # only a dangling `;` or whitespace after the calls
                break
            if text[start] != "{":
                break
            decoded = decode_json(text, start)
            if decoded is None and not final:
                return out, pos  # the object is still arriving
            call = call_from_object(decoded[0]) if decoded else None
            if call is None:
                break
            out.append(call)
            pos = decoded[1]
            self._state = "calls"
        self._state = "content"
        out.append(text[pos:])
        return out, len(text)


class Llama3JsonToolParser(ToolParser):
    def scanner(self) -> Scanner:
        return _Llama3Scanner()
