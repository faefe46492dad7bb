"""The engine's logprobs ({token id: logprob} per token: the top-n best first, then the
sampled token if it is not among them) in OpenAI's two formats."""
from __future__ import annotations

from gateway.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from tokenizer_svc.tokenizer import Tokenizer


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Special tokens are shown, as OpenAI and vLLM do: a logprob belongs to a token.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return list(entry.items())[:num_top]


class CompletionLogprobsBuilder:
    """The legacy format; text_offset runs on across the chunks of one stream."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, text_offset: int) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top
        self._offset = text_offset

    def build(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            text = _token_text(self._tokenizer, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry[token_id])
            out.top_logprobs.append({_token_text(self._tokenizer, t): lp for t, lp in _top(entry, self._num_top)})
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int
) -> list[ChatTokenLogprob]:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        top = [
            TopLogprob(token=(t := _token_text(tokenizer, other)), logprob=lp, bytes=list(t.encode()))
            for other, lp in _top(entry, num_top)
        ]
        content.append(ChatTokenLogprob(token=text, logprob=entry[token_id], bytes=list(text.encode()), top_logprobs=top))
    return content
