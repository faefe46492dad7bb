"""`mistral`: after the `[TOOL_CALLS]` token, either a JSON array of calls (older Mistral
models) or, in the newer format, the name then `[ARGS]` then the arguments object, one
`[TOOL_CALLS]` per call. Text before the token is content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The tokens are special tokens: the output must be detokenized with them kept.
"""
from __future__ import annotations

import re

from .base import Scanner, Segment, ToolCall, ToolParser
from .common import calls_from_json, decode_json, make_call, scan_blocks, skip_ws

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.-]+")


def _read_block(text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
    start = skip_ws(text, pos)
    if start == len(text):
        return None
    if text[start] in "[{":  # the JSON form: an array of calls (or one call object)
        decoded = decode_json(text, start)
        if decoded is None:
            return None  # unfinished; at the end, malformed
        return calls_from_json(decoded[0]), decoded[1]
    name = _NAME.match(text, start)
    if name is None:
        return None, start  # not a call after all: the marker is plain text
    rest = text[name.end():name.end() + len(ARGS)]
    if rest != ARGS:
        # The name or the `[ARGS]` token may still be arriving.
        return None if ARGS.startswith(rest) else (None, start)
    decoded = decode_json(text, skip_ws(text, name.end() + len(ARGS)))
    if decoded is None:
        return None
    call = make_call(name.group(), decoded[0])
    return ([call] if call else None), decoded[1]


class _MistralScanner:
    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        return scan_blocks(text, MARKER, final, _read_block)


class MistralToolParser(ToolParser):
    def scanner(self) -> Scanner:
        return _MistralScanner()
