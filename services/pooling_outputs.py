"""vLLM-shaped results of a pooling request, and the prompt check every front door makes
before one (the SDK, the gateway, the engine protocol)."""
from __future__ import annotations

from dataclasses import dataclass

from services.invalid_parameter import InvalidParameter


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label; raw logits without the activation

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput: `outputs.embedding` from LLM.embed, `outputs.probs` from
    LLM.classify, `outputs.score` from LLM.score."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    finished: bool = True


def fit_pooling_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int,
                       param: str = "input") -> list[int]:
    """The prompt cut to its first `truncate_prompt_tokens` (-1: max_model_len) tokens, as an
    embedder's tokenizer truncates; longer than the model's positions otherwise is refused
    with vLLM's words."""
    keep = truncate_prompt_tokens
    if keep is not None:
        if keep > max_model_len:
            raise InvalidParameter("truncate_prompt_tokens", f"truncate_prompt_tokens value ({keep}) is greater "
                                   f"than max_model_len ({max_model_len}). Please, select a smaller truncation size.")
        token_ids = token_ids[:max_model_len if keep == -1 else keep]
    if len(token_ids) > max_model_len:
        raise InvalidParameter(param, f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {len(token_ids)} tokens in the input for embedding generation. Please "
                               "reduce the length of the input.")
    return token_ids
