"""vLLM's engine protocol (`vllm.grpc.engine`, PyPI smg-grpc-proto) to kvfleet's own
types and back: a GenerateRequest's prompt and sampling, and token deltas as
GenerateResponse chunks and completions.

What kvfleet lacks (media, KV transfer) is refused with INVALID_ARGUMENT naming the
field, never ignored.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from scheduler_svc.engine_protocol.text import StopStrings
from services.invalid_parameter import InvalidParameter
from services.messages import TokenDelta
from services.sampling_params import MAX_LOGPROBS, SamplingParams
from services.structured_outputs import StructuredOutputsParams


def prompt_from_request(request: pb.GenerateRequest, encode: Callable[[str], list[int]]) -> list[int]:
    """The prompt's token ids (`encode` tokenizes a text prompt); raises InvalidParameter
    for what this engine cannot take."""
    if request.WhichOneof("input") is None:
        raise InvalidParameter("input", "send the prompt as tokenized.input_ids or as text")
    if request.WhichOneof("input") == "tokenized" and not request.tokenized.input_ids:
        raise InvalidParameter("tokenized", "input_ids must not be empty")
    # Media and KV transfer (disaggregated prefill) are features this engine lacks.
    for name in ("kv_transfer_params", "mm_inputs", "media_refs"):
        if request.HasField(name):
            raise InvalidParameter(name, "not supported by kvfleet")
    if request.extra_mm_inputs:
        raise InvalidParameter("extra_mm_inputs", "not supported by kvfleet")
    if request.HasField("kv_transfer_params_json"):
        raise InvalidParameter("kv_transfer_params_json", "not supported by kvfleet")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidParameter("data_parallel_rank", "this replica has one rank, 0")
    if request.WhichOneof("input") == "text":
        return encode(request.text)
    return list(request.tokenized.input_ids)


def _constraint(message: pb.SamplingParams) -> StructuredOutputsParams | None:
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    # The scheduler runs no reasoning parser: a constraint always starts at the first
    # generated token, which is what grammar_from_first_token asks for (set or not).
    if kind == "json_schema":
        return StructuredOutputsParams(json=message.json_schema, field_name="json_schema")
    if kind == "choice":
        return StructuredOutputsParams(choice=list(message.choice.choices), field_name="choice")
    return StructuredOutputsParams(**{kind: getattr(message, kind)}, field_name=kind)


def sampling_params_from_engine_protocol(message: pb.SamplingParams) -> SamplingParams:
    """vLLM's servicer reads proto3 zeros as "unset": top_p 0 is 1, repetition_penalty 0 is
    1, n 0 is 1. Raises InvalidParameter (a ValueError) naming the offending field."""
    for name in ("logprobs", "prompt_logprobs"):
        if message.HasField(name) and getattr(message, name) < 0:
            raise InvalidParameter(name, "-1 (the whole vocabulary) is not supported: ask for k >= 0")
        if message.HasField(name) and getattr(message, name) > MAX_LOGPROBS:
            raise InvalidParameter(name, f"at most {MAX_LOGPROBS} (vLLM's max_logprobs), got {getattr(message, name)}")
    return SamplingParams(
        n=message.n or 1,
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        min_p=message.min_p,
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        min_tokens=message.min_tokens,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        include_stop_str_in_output=message.include_stop_str_in_output,
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        seed=message.seed if message.HasField("seed") else None,
        logit_bias=dict(message.logit_bias) or None,
        truncate_prompt_tokens=message.truncate_prompt_tokens if message.HasField("truncate_prompt_tokens") else None,
        # How stop strings are matched: on text detokenized with these.
        skip_special_tokens=message.skip_special_tokens,
        spaces_between_special_tokens=message.spaces_between_special_tokens,
        structured_outputs=_constraint(message),
    )


def _top(position: dict[int, float], top_k: int) -> pb.TopLogProbs:
    top = list(position.items())[:top_k]
    return pb.TopLogProbs(token_ids=[token for token, _ in top], values=[logprob for _, logprob in top])


def output_logprobs(token_ids: list[int], positions: list[dict[int, float]], top_k: int) -> pb.OutputLogProbs:
    """kvfleet's positions list the top-k best first, then the sampled token when it is not among them."""
    result = pb.OutputLogProbs()
    for token, position in zip(token_ids, positions):
        result.token_ids.append(token)
        result.token_logprobs.append(position[token])
        result.top_logprobs.append(_top(position, top_k))
    return result


def input_logprobs(prompt: list[int], positions: list[dict[int, float]], top_k: int) -> pb.InputLogProbs:
    """The first prompt token has no logprob: an empty entry, as vLLM sends it."""
    result = pb.InputLogProbs(token_ids=prompt)
    result.token_logprobs.append(pb.InputTokenLogProb())
    result.top_logprobs.append(pb.TopLogProbs())
    for token, position in zip(prompt[1:], positions):
        result.token_logprobs.append(pb.InputTokenLogProb(value=position[token]))
        result.top_logprobs.append(_top(position, top_k))
    return result


@dataclass
class Completion:
    """One of a request's n outputs, as its deltas arrive."""

    index: int
    prompt: list[int]
    params: SamplingParams
    stop_strings: StopStrings | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: pb.OutputLogProbs = field(default_factory=pb.OutputLogProbs)
    prompt_logprobs: pb.InputLogProbs | None = None
    cached_tokens: int = 0  # of the prompt, from the prefix cache: told with the first token
    last: TokenDelta | None = None  # the final delta, once it came

    def add(self, delta: TokenDelta) -> pb.GenerateStreamChunk:
        """Takes the delta in; returns it as a stream chunk."""
        chunk = pb.GenerateStreamChunk(token_ids=delta.new_token_ids, prompt_tokens=len(self.prompt),
                                       index=self.index)
        self.token_ids += delta.new_token_ids
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        chunk.completion_tokens, chunk.cached_tokens = len(self.token_ids), self.cached_tokens
        if self.params.logprobs is not None and delta.new_token_ids:
            chunk.output_logprobs.CopyFrom(output_logprobs(delta.new_token_ids, delta.logprobs, self.params.logprobs))
            self.logprobs.MergeFrom(chunk.output_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = input_logprobs(self.prompt, delta.prompt_logprobs, self.params.prompt_logprobs or 0)
            chunk.input_logprobs.CopyFrom(self.prompt_logprobs)
        return chunk

    def complete(self, last: TokenDelta, with_outputs: bool) -> pb.GenerateComplete:
        """The final message; `with_outputs`: it carries every token (not streamed: no chunk did)."""
        complete = pb.GenerateComplete(finish_reason=last.finish_reason, prompt_tokens=len(self.prompt),
                                       completion_tokens=len(self.token_ids), cached_tokens=self.cached_tokens,
                                       index=self.index)
        if isinstance(last.stop_reason, int):
            complete.matched_token_id = last.stop_reason
        elif isinstance(last.stop_reason, str):
            complete.matched_stop_str = last.stop_reason
        if with_outputs:
            complete.output_ids.extend(self.token_ids)
            if self.params.logprobs is not None:
                complete.output_logprobs.CopyFrom(self.logprobs)
            if self.prompt_logprobs is not None:
                complete.input_logprobs.CopyFrom(self.prompt_logprobs)
        return complete
