"""Beam search over the engine, as vLLM's `LLM.beam_search` does it.

Each round asks the engine for one more token of every live beam with the top
2 x beam_width logprobs; the best beam_width extensions survive. Beams share their
prompt and every common prefix through the prefix cache, so a round recomputes
little more than the newest token of each beam. Finished beams (EOS) are ranked
with the others by cumulative logprob / length ** length_penalty.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.sampling_params import InvalidParameter, SamplingParams


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
class Beam:
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float = 0.0
    finished: bool = False


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    beams: list[Beam] = field(default_factory=list)  # best first


# Runs one round: a batch of token-id prompts, one new token each, with its top logprobs.
NextTokens = Callable[[list[list[int]], SamplingParams], list[dict[int, float]]]


def beam_search(
    prompt: list[int], params: BeamSearchParams, eos_token_ids: tuple[int, ...], next_tokens: NextTokens
) -> BeamSearchOutput:
    round_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    live = [Beam([])]
    finished: list[Beam] = []
    for _ in range(params.max_tokens):
        candidates = []
        for beam, top in zip(live, next_tokens([prompt + b.token_ids for b in live], round_params)):
            for token, logprob in top.items():
                ends = not params.ignore_eos and token in eos_token_ids
                candidates.append(Beam(beam.token_ids + [token], beam.cumulative_logprob + logprob, ends))
        candidates.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        live = []
        for candidate in candidates[: 2 * params.beam_width]:
            (finished if candidate.finished else live).append(candidate)
            if len(live) == params.beam_width:
                break
        if not live:
            break

    def score(beam: Beam) -> float:
        length = len(prompt) + len(beam.token_ids) - (1 if beam.finished else 0)
        return beam.cumulative_logprob / length**params.length_penalty

    ranked = sorted(finished + live, key=score, reverse=True)[: params.beam_width]
    return BeamSearchOutput(prompt, ranked)
