"""The engine's logprobs ({token id: logprob} per token: the top-n best first, then the
sampled token if it is not among them) in OpenAI's two formats, and vLLM's prompt_logprobs.
With vLLM's return_tokens_as_token_ids the formats name each token "token_id:N" (text
the tokenizer cannot split between tokens stays identifiable) instead of its text."""
from __future__ import annotations

import functools

from gateway.responses import ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
from tokenizer_svc.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1 << 18)
def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """Decoded once per token: a request for the whole vocabulary's logprobs (-1) names
    every token at every position. Special tokens are shown, as OpenAI and vLLM do: a
    logprob belongs to a token."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _token_name(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else _token_text(tokenizer, token_id)


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return list(entry.items())[:num_top]


class CompletionLogprobsBuilder:
    """The legacy format; text_offset runs on across the chunks of one stream."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top
        self._as_ids = as_ids
        self._offset = 0

    def build(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> CompletionLogprobs:
        """`None` stands for a token without a logprob: the first of an echoed prompt."""
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            # As vLLM: with token ids for names, the offsets count the names' characters.
            text = _token_name(self._tokenizer, token_id, self._as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(None if entry is None else entry[token_id])
            out.top_logprobs.append(None if entry is None else self._top(token_id, entry))
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out

    def _top(self, token_id: int, entry: dict[int, float]) -> dict[str, float]:
        """As vLLM and OpenAI's legacy API: the token itself, then the most likely others,
        up to `logprobs` + 1 (so `logprobs: 0` still shows the token's own logprob)."""
        ranked = [(token_id, entry[token_id]), *((t, lp) for t, lp in entry.items() if t != token_id)]
        return {_token_name(self._tokenizer, t, self._as_ids): lp for t, lp in ranked[: self._num_top + 1]}

    def build_echo(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[dict[int, float]],
        token_ids: list[int],
        logprobs: list[dict[int, float]],
    ) -> CompletionLogprobs:
        """echo with logprobs, as OpenAI's legacy API: the prompt's tokens, then the completion's.
        Prompt entries are aligned to the prompt's length, so no entry can shift onto a
        completion token."""
        entries: list[dict[int, float] | None] = [None, *prompt_logprobs][: len(prompt_token_ids)]
        entries += [None] * (len(prompt_token_ids) - len(entries))
        return self.build([*prompt_token_ids, *token_ids], [*entries, *logprobs])


def prompt_logprobs(tokenizer: Tokenizer, entries: list[dict[int, float]], num_top: int) -> PromptLogprobs:
    """vLLM's shape: None for the first prompt token, then {token id: logprob, rank, decoded token}.
    An entry holds the top `num_top` (ranks 1..num_top), then the actual token when it
    ranks lower, at a rank the engine does not report."""
    out: PromptLogprobs = [None]
    for entry in entries:
        out.append({
            token_id: PromptLogprob(
                logprob=logprob, rank=rank + 1 if rank < num_top else None, decoded_token=_token_text(tokenizer, token_id)
            )
            for rank, (token_id, logprob) in enumerate(entry.items())
        })
    return out


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int, as_ids: bool = False
) -> list[ChatTokenLogprob]:
    """`bytes` are the token's text's, as OpenAI defines them, whatever names the token."""
    def logprob(token_id: int, value: float) -> TopLogprob:
        text = _token_text(tokenizer, token_id)
        return TopLogprob(token=f"token_id:{token_id}" if as_ids else text, logprob=value, bytes=list(text.encode()))

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = logprob(token_id, entry[token_id])
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                        top_logprobs=[logprob(other, lp) for other, lp in _top(entry, num_top)]))
    return content
