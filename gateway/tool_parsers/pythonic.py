"""`pythonic`: Llama 3.2 / Llama 4 style. The output is one Python list of calls with literal
keyword arguments, optionally wrapped in `<|python_start|>...<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time()]

It is read with `ast`, never evaluated. An output that is not such a list is plain content;
text after the list is content.
"""
from __future__ import annotations

import ast
import re

from .base import Scanner, Segment, ToolCall, ToolParser
from .common import make_call, skip_ws, starts_with

START = "<|python_start|>"
END = "<|python_end|>"
# How a list of calls opens, and what may still turn into that opening: used to pass plain
# text (a markdown link, a list of numbers) through without holding it to the end.
_HEAD = re.compile(r"\[\s*[^\W\d]\w*\s*\(")
_HEAD_PREFIX = re.compile(r"\[\s*(?:[^\W\d]\w*\s*)?")


def _head(text: str, pos: int) -> bool | None:
    if _HEAD.match(text, pos):
        return True
    return None if pos == len(text) or _HEAD_PREFIX.fullmatch(text, pos) else False


class _Brackets:
    """Finds the bracket that closes the list, reading each character once as the text
    grows: the bracket depth outside string literals. (Parsing the text at every `]` instead
    would be quadratic in a long list.) Only then is the list parsed, once."""

    def __init__(self) -> None:
        self._pos = 0  # how far the text has been read
        self._depth = 0
        self._quote = ""  # the open string literal's quote: ', ", \'\'\' or \"\"\"

    def find_close(self, text: str, start: int, final: bool) -> int | None:
        pos = max(self._pos, start)
        while pos < len(text):
            ch, rest = text[pos], text[pos:pos + 3]
            if self._quote:
                if ch == "\\":
                    if pos + 1 == len(text) and not final:
                        break  # what it escapes has not arrived yet
                    pos += 2
                    continue
                if self._quote.startswith(rest) and len(rest) < len(self._quote) and not final:
                    break  # maybe the start of the closing quotes
                if rest.startswith(self._quote):
                    pos += len(self._quote)
                    self._quote = ""
                    continue
            elif ch in "'\"":
                if rest in (ch, ch * 2) and not final:
                    break  # an empty string, or a triple quote still arriving
                self._quote = ch * 3 if rest == ch * 3 else ch
                pos += len(self._quote)
                continue
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return pos  # closes the list (a mismatched bracket fails the parse)
            pos += 1
        self._pos = pos
        return None


def _calls(node: ast.expr) -> list[ToolCall] | None:
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for element in node.elts:
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name) or element.args:
            return None
        arguments = {}
        for keyword in element.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None  # not a literal: a name, a call, an expression
        call = make_call(element.func.id, arguments)
        if call is None:
            return None
        calls.append(call)
    return calls


class _PythonicScanner:
    def __init__(self) -> None:
        self._state = "start"  # then "after" (the list was read) or "content"
        self._brackets = _Brackets()

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        if self._state == "start":
            return self._scan_list(text, final)
        used = len(text)
        if self._state == "after":
            start = skip_ws(text, 0)
            end = starts_with(text, start, END)
            if end is None and not final:
                return [], 0
            if end:  # the wrapper's close is not content
                text = text[start + len(END):]
        self._state = "content"
        return [text], used

    def _scan_list(self, text: str, final: bool) -> tuple[list[Segment], int]:
        start = skip_ws(text, 0)
        wrapped = starts_with(text, start, START)
        if wrapped is None and not final:
            return [], 0
        if wrapped:
            start = skip_ws(text, start + len(START))
        head = _head(text, start)
        if head is None and not final:
            return [], 0
        if head:
            found = self._find_list(text, start, final)
            if found is None and not final:
                return [], 0
            if found is not None and found[0] is not None:
                calls, end = found
                self._state = "after"
                rest, used = self.scan(text[end:], final)
                return [*calls, *rest], end + used
        self._state = "content"
        return [text], len(text)

    def _find_list(self, text: str, start: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
        """The list's calls (None: it is not a list of calls) and its end; None until it closes."""
        close = self._brackets.find_close(text, start, final)
        if close is None:
            return None
        try:
            tree = ast.parse(text[start:close + 1], mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):  # also null bytes, absurd nesting
            return None, close + 1
        return _calls(tree.body), close + 1


class PythonicToolParser(ToolParser):
    def scanner(self) -> Scanner:
        return _PythonicScanner()
