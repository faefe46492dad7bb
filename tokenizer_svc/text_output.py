"""Turns token deltas into text: incremental detokenization and stop strings.

`TextStream` handles one request and serves every front end (the offline SDK and
the gateway's streams); `OutputProcessor` collects the SDK's RequestOutputs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.messages import TokenDelta
from services.outputs import CompletionOutput, RequestOutput
from services.parallel_sampling import child_params, engine_request_ids, num_children
from services.sampling_params import SamplingParams
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.tokenizer import Tokenizer


@dataclass
class TextDelta:
    text: str  # new text, already cut at a stop string
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    # True when a stop string ended the request here: the engine must still abort it.
    hit_stop_string: bool = False


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.text = ""  # the text so far, as the client sees it
        self._raw_text = ""  # before stop-string truncation
        self.finished = False
        # A stop string may begin in text already decoded: hold back enough of the
        # tail that no emitted character ever has to be taken back.
        self._hold_back = 0 if params.include_stop_str_in_output or not params.stop else max(map(len, params.stop)) - 1

    def apply(self, delta: TokenDelta) -> TextDelta:
        tokens, hit = self._decode(delta.new_token_ids)
        if len(tokens) == len(delta.new_token_ids):
            result = TextDelta("", tokens, delta.logprobs, delta.finish_reason, delta.stop_reason)
        else:  # a stop string cut the delta: the tokens after it are not output
            logprobs = delta.logprobs[: len(tokens)] if delta.logprobs is not None else None
            result = TextDelta("", tokens, logprobs, None, None)
        if hit is not None:
            end, stop = hit
            result.finish_reason, result.stop_reason = "stop", stop
            result.hit_stop_string = delta.finish_reason is None
        elif delta.finish_reason is not None:
            end = len(self._raw_text)
        else:
            end = max(len(self.text), len(self._raw_text) - self._hold_back)
        result.text = self._raw_text[len(self.text) : end]
        self.text += result.text
        self.finished = result.finish_reason is not None
        return result

    def _decode(self, token_ids: list[int]) -> tuple[list[int], tuple[int, str] | None]:
        """Detokenizes a delta: (its tokens up to the one completing a stop string, the hit).
        With stop strings, a delta of several tokens (speculative decoding's accepted run)
        goes one token at a time, so it ends where the same tokens one by one would."""
        step = 1 if self.params.stop and len(token_ids) > 1 else max(1, len(token_ids))
        for start in range(0, max(1, len(token_ids)), step):
            new_text = self.detokenizer.step(token_ids[start : start + step])
            self._raw_text += new_text
            hit = _find_stop_string(self._raw_text, len(new_text), self.params)
            if hit is not None:
                return token_ids[: start + step], hit
        return token_ids, None


def _find_stop_string(text: str, new_chars: int, params: SamplingParams) -> tuple[int, str] | None:
    """(where the visible text ends, stop string) for the earliest stop string the new text completes."""
    best: tuple[int, str] | None = None
    for stop in params.stop:
        # Only a match that ends inside the new text is new.
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return (index + len(stop) if params.include_stop_str_in_output else index), stop


@dataclass
class _Child:
    parent: RequestOutput
    completion: CompletionOutput
    stream: TextStream


class OutputProcessor:
    """Collects the SDK's RequestOutputs; a request with n > 1 gathers its children."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, _Child] = {}
        self._params: dict[str, SamplingParams] = {}
        self._unfinished: dict[str, int] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        count = num_children(params)
        output = RequestOutput(request_id, prompt, prompt_token_ids)
        for index, child_id in enumerate(engine_request_ids(request_id, count)):
            child = child_params(params, index)
            completion = CompletionOutput(index, "", [])
            if child.logprobs is not None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            output.outputs.append(completion)
            self._children[child_id] = _Child(output, completion, TextStream(self.tokenizer, prompt_token_ids, child))
        self._params[request_id] = params
        self._unfinished[request_id] = count

    def process(self, deltas: list[TokenDelta], abort: Callable[[str], object]) -> list[RequestOutput]:
        """Apply deltas; return the outputs that finished. A stop-string hit ends the
        request here and calls `abort` so the engine frees it."""
        finished = []
        for delta in deltas:
            child = self._children.get(delta.request_id)
            if child is None:
                continue
            update = child.stream.apply(delta)
            if delta.prompt_logprobs is not None and child.parent.prompt_logprobs is None:
                child.parent.prompt_logprobs = [None, *delta.prompt_logprobs]
            child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, delta.num_cached_tokens)
            completion = child.completion
            completion.text += update.text
            completion.token_ids.extend(update.token_ids)
            if update.logprobs is not None:
                completion.logprobs.extend(update.logprobs)
                completion.cumulative_logprob += sum(e[t] for e, t in zip(update.logprobs, update.token_ids))
            if update.hit_stop_string:
                abort(delta.request_id)
            if update.finish_reason is None:
                continue
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
            del self._children[delta.request_id]
            request_id = child.parent.request_id
            self._unfinished[request_id] -= 1
            if self._unfinished[request_id] == 0:
                finished.append(self._finalize(child.parent, self._params.pop(request_id)))
                del self._unfinished[request_id]
        return finished

    @staticmethod
    def _finalize(output: RequestOutput, params: SamplingParams) -> RequestOutput:
        if params.best_of and params.best_of > params.n:
            best = sorted(output.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
            for index, completion in enumerate(best):
                completion.index = index
                if params.logprobs is None:  # computed only to rank the candidates
                    completion.logprobs = completion.cumulative_logprob = None
            output.outputs = best
        output.finished = True
        return output
