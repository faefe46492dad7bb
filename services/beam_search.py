"""Beam search over the engine, as vLLM's `LLM.beam_search` does it.

Each round asks the engine for one more token of every live beam with the top
2 x beam_width logprobs; the best beam_width extensions survive. Beams share their
prompt and every common prefix through the prefix cache, so a round recomputes
little more than the newest token of each beam. Finished beams (EOS) are ranked
with the others by cumulative logprob / length ** length_penalty.

The results have vLLM's shape (vllm/beam_search.py): a BeamSearchOutput whose
`sequences` are BeamSearchSequences holding prompt + generated tokens, as vLLM's do.
`text` is left to the caller, which has the tokenizer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.invalid_parameter import InvalidParameter
from services.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise InvalidParameter("beam_width", f"must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise InvalidParameter("max_tokens", f"must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One beam, with vLLM's field names."""

    tokens: list[int]  # prompt + generated, as in vLLM
    # Per generated token, the {token id: logprob} top candidates of its round.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # set by the SDK, which holds the tokenizer
    finish_reason: str | None = None  # "stop" at EOS, "length" otherwise
    stop_reason: int | str | None = None  # always None: only EOS ends a beam, as in vLLM


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the beam_width best, best first


# Runs one round: a batch of token-id prompts, one new token each, with its top logprobs.
NextTokens = Callable[[list[list[int]], SamplingParams], list[dict[int, float]]]


def beam_search(
    prompt: list[int], params: BeamSearchParams, eos_token_ids: tuple[int, ...], next_tokens: NextTokens
) -> BeamSearchOutput:
    round_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    live = [BeamSearchSequence(list(prompt))]
    finished: list[BeamSearchSequence] = []
    for _ in range(params.max_tokens):
        candidates = []
        for beam, top in zip(live, next_tokens([b.tokens for b in live], round_params)):
            for token, logprob in top.items():
                ends = not params.ignore_eos and token in eos_token_ids
                candidates.append(BeamSearchSequence(
                    beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + logprob,
                    finish_reason="stop" if ends else None,
                ))
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        live = []
        for candidate in candidates[: 2 * params.beam_width]:
            (finished if candidate.finish_reason else live).append(candidate)
            if len(live) == params.beam_width:
                break
        if not live:
            break
    for beam in live:  # still running when max_tokens ran out
        beam.finish_reason = "length"

    def score(beam: BeamSearchSequence) -> float:
        # The EOS that ended a beam does not count towards its length, as in vLLM and transformers.
        length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
        return beam.cum_logprob / length**params.length_penalty

    return BeamSearchOutput(sorted(finished + live, key=score, reverse=True)[: params.beam_width])
