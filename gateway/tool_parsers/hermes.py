"""`hermes`: Hermes 2 Pro and Qwen 2.5/3 style. Each call is a JSON object
`{"name": ..., "arguments": {...}}` in its own `<tool_call>...</tool_call>` block, with free
text around the blocks:

    I'll check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import json

from .base import Scanner, Segment, ToolCall, ToolParser
from .common import calls_from_json, scan_blocks

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _calls(body: str) -> list[ToolCall] | None:
    try:
        return calls_from_json(json.loads(body))
    except (ValueError, RecursionError):
        return None


def _read_block(text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
    close = text.find(CLOSE, pos)
    if close >= 0:
        return _calls(text[pos:close]), close + len(CLOSE)
    if not final:
        return None
    # The output ended inside the block (a stop string or max_tokens ate the close tag):
    # the JSON may still be whole, as vLLM also assumes.
    return _calls(text[pos:]), len(text)


class _HermesScanner:
    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        return scan_blocks(text, OPEN, final, _read_block)


class HermesToolParser(ToolParser):
    def scanner(self) -> Scanner:
        return _HermesScanner()
