"""Turns token deltas into text: incremental detokenization and stop strings, per request."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.messages import TokenDelta
from services.outputs import CompletionOutput, RequestOutput
from services.sampling_params import SamplingParams
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.tokenizer import Tokenizer


@dataclass
class _Tracked:
    output: RequestOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Tracked] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        output = RequestOutput(request_id, prompt, prompt_token_ids, [CompletionOutput(0, "", [])])
        self._requests[request_id] = _Tracked(output, params, detokenizer)

    def process(self, deltas: list[TokenDelta], abort: Callable[[str], object]) -> list[RequestOutput]:
        """Apply deltas; return the outputs that finished. A stop-string hit ends the
        request here and calls `abort` so the engine frees it."""
        finished = []
        for delta in deltas:
            tracked = self._requests.get(delta.request_id)
            if tracked is None:
                continue
            completion = tracked.output.outputs[0]
            completion.token_ids.extend(delta.new_token_ids)
            new_text = tracked.detokenizer.step(delta.new_token_ids)
            completion.text += new_text
            finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
            hit = self._find_stop_string(completion.text, len(new_text), tracked.params)
            if hit is not None:
                completion.text, stop_reason = hit
                finish_reason = "stop"
                if delta.finish_reason is None:
                    abort(delta.request_id)
            if finish_reason is not None:
                completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
                tracked.output.finished = True
                finished.append(tracked.output)
                del self._requests[delta.request_id]
        return finished

    @staticmethod
    def _find_stop_string(text: str, new_chars: int, params: SamplingParams) -> tuple[str, str] | None:
        """(truncated text, stop string) for the earliest stop string that the new text completes."""
        best: tuple[int, str] | None = None
        for stop in params.stop:
            # Only a match that ends inside the new text is new.
            search_from = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if params.include_stop_str_in_output else index
        return text[:end], stop
