"""Reasoning parsers: split a `<think>...</think>` section off the output as
`reasoning` (also sent as `reasoning_content`), the way vLLM's `--reasoning-parser` options do.

- `deepseek_r1`: the chat template may put `<think>` in the prompt, so the output may lack
  it; everything before `</think>` is reasoning, and with no `</think>` at all the model is
  still thinking: all of it is reasoning.
- `qwen3`: reasoning only when `<think>` opens the output (after whitespace); otherwise all
  of it is content. An opened section that never closes is all reasoning.

Only a `<think>` at the very start counts as the opening tag; after `</think>` everything is
content, tags included. Both parts are stripped of surrounding whitespace and are None when
empty; the stream sends the same text (see base.StripStream).
"""
from __future__ import annotations

from .base import StripStream
from .common import partial_suffix

THINK = "<think>"
END_THINK = "</think>"


class ReasoningParser:
    # Whether the output must open with `<think>` to have any reasoning in it.
    requires_open_tag = False

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content)."""
        head = text.lstrip()
        if head.startswith(THINK):
            text = head[len(THINK):]
        elif self.requires_open_tag:
            return None, text.strip() or None
        reasoning, _, content = text.partition(END_THINK)
        return reasoning.strip() or None, content.strip() or None

    def stream(self) -> StreamingReasoningParser:
        return StreamingReasoningParser(self.requires_open_tag)

    def thinks_after(self, prompt: str) -> bool:
        """Whether the output may open with reasoning, by the rendered prompt: not when the
        template already closed a think section (thinking turned off, "<think></think>")."""
        return END_THINK not in prompt.rpartition(THINK)[2] or THINK not in prompt


class DeepSeekR1ReasoningParser(ReasoningParser):
    requires_open_tag = False


class Qwen3ReasoningParser(ReasoningParser):
    requires_open_tag = True


class StreamingReasoningParser:
    def __init__(self, requires_open_tag: bool) -> None:
        self._requires_open_tag = requires_open_tag
        self._state = "start"  # then "reasoning", then "content"
        self._pending = ""  # text not sent yet: a possible partial tag
        self._reasoning = StripStream()
        self._content = StripStream()

    @property
    def reasoning_ended(self) -> bool:
        """True once the rest of the output is content (`</think>` seen, or no reasoning)."""
        return self._state == "content"

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "start":
            head = self._pending.lstrip()
            if not final and THINK.startswith(head) and head != THINK:
                return "", ""  # nothing but (part of) the opening tag yet
            if head.startswith(THINK):
                self._pending = head[len(THINK):]
                self._state = "reasoning"
            else:
                self._state = "content" if self._requires_open_tag else "reasoning"
        if self._state == "reasoning":
            end = self._pending.find(END_THINK)
            if end >= 0:
                reasoning = self._pending[:end]
                self._pending = self._pending[end + len(END_THINK):]
                self._state = "content"
            else:
                keep = 0 if final else partial_suffix(self._pending, END_THINK)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        content = ""
        if self._state == "content":
            content, self._pending = self._pending, ""
        return self._reasoning.push(reasoning), self._content.push(content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {', '.join(REASONING_PARSERS)}") from None
