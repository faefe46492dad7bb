"""Text and JSON helpers the format scanners share."""
from __future__ import annotations

import json
import re
from collections.abc import Callable

from .base import Segment, ToolCall

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")


def skip_ws(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker`: what a
    stream must hold back, since the next delta may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def starts_with(text: str, pos: int, token: str) -> bool | None:
    """Whether `text[pos:]` starts with `token`; None while it is still a proper prefix of it
    (including empty), since then only more text can tell."""
    head = text[pos:pos + len(token)]
    if head == token:
        return True
    return None if token.startswith(head) else False


def decode_json(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at `pos` and where it ends, or None (incomplete or invalid).
    A value that decodes here decodes the same however much text follows it."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def make_call(name: str, arguments: object) -> ToolCall | None:
    if isinstance(arguments, str):  # some models send the arguments object as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:  # allow_nan=False: NaN is not JSON, and the client must be able to parse the text
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return None


def call_from_object(obj: object) -> ToolCall | None:
    """A call from `{"name": ..., "arguments": {...}}` ("parameters" also accepted; absent = {})."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or not name:
        return None
    return make_call(name, {} if arguments is None else arguments)


def calls_from_json(obj: object) -> list[ToolCall] | None:
    """An object is one call; a list must be a non-empty list of calls."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_object(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


# A block reader: given the text and the position right after a block's marker, it returns
# None while the block is unfinished, else (the calls, or None when the block is malformed;
# the position after the block).
BlockReader = Callable[[str, int, bool], "tuple[list[ToolCall] | None, int] | None"]


def scan_blocks(text: str, marker: str, final: bool, read_block: BlockReader) -> tuple[list[Segment], int]:
    """Plain text with call blocks in it, each opened by `marker`. A malformed block stays in
    the content as written; the calls before and after it still count."""
    out: list[Segment] = []
    pos = 0
    while True:
        start = text.find(marker, pos)
        if start < 0:
            end = len(text) if final else len(text) - partial_suffix(text[pos:], marker)
            out.append(text[pos:end])
            return out, end
        out.append(text[pos:start])
        block = read_block(text, start + len(marker), final)
        if block is None:
            if not final:
                return out, start  # wait for the rest of the block
            block = (None, len(text))  # it never finished: the rest is content
        calls, end = block
        if calls:
            out.extend(calls)
        else:
            out.append(text[start:end])
        pos = end
