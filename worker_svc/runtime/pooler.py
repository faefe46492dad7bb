"""The pooling runner's last step (docs/pooling.md): a pooling request's hidden states
become one vector. Prompts arrive in chunks, as any prefill: MEAN sums each chunk's
rows as they go, CLS keeps the first row, LAST takes the prompt's last; the vector
leaves with the step that computes the prompt's end, and the request ends there."""
from __future__ import annotations

from collections.abc import Callable

import torch

from services.config import EngineConfig
from services.messages import StepPlan
from services.pooling_params import PoolerConfig
from worker_svc.formats.model_config import ModelConfig
from worker_svc.runtime.batch import RequestState


class Pooler:
    def __init__(self, config: PoolerConfig, final_norm: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`final_norm`: what turns the model's forward output into its last hidden states
        (a decoder's final norm, which its forward leaves to the rows that sample); `head`:
        a classifier's, from the pooled vectors [N, H] to logits [N, labels]."""
        self.config = config
        self.final_norm = final_norm
        self.head = head

    def pool(self, plan: StepPlan, row_starts: list[int], hidden: torch.Tensor,
             requests: dict[str, RequestState]) -> dict[str, list[float]]:
        """The vectors of the pooling requests whose prompt this step ends; the others'
        chunks are folded into their state. Call before their computed counts advance."""
        pooled = {}
        kind = self.config.pooling_type
        for start_row, (request_id, count) in zip(row_starts, plan.num_scheduled_tokens.items()):
            state = requests[request_id]
            if state.sampling_params.pooling is None:
                continue
            first = state.num_computed_tokens
            ends = first + count == state.num_prompt_tokens
            if kind == "MEAN":
                chunk = self.final_norm(hidden[start_row:start_row + count]).float().sum(0)
                state.pooled = chunk if state.pooled is None else state.pooled + chunk
            elif kind == "CLS" and first == 0:
                state.pooled = self.final_norm(hidden[start_row:start_row + 1]).float()[0]
            elif kind == "LAST" and ends:
                state.pooled = self.final_norm(hidden[start_row + count - 1:start_row + count]).float()[0]
            if ends:
                vector = state.pooled / state.num_prompt_tokens if kind == "MEAN" else state.pooled
                pooled[request_id] = self.finish(vector, state).tolist()
        return pooled

    def finish(self, vector: torch.Tensor, state: RequestState) -> torch.Tensor:
        """The request's dimensions (a Matryoshka prefix), then its normalization; a
        classifier's label scores instead."""
        params = state.sampling_params.pooling
        if self.head is not None:
            logits = self.head(vector[None])[0].float()
            if params.use_activation is False:
                return logits
            return torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, dim=0)
        dimensions = params.dimensions or self.config.dimensions
        if dimensions is not None:
            vector = vector[:dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def resolve_pooler(config: EngineConfig, model_config: ModelConfig, defaults: dict) -> PoolerConfig | None:
    """How this worker pools, or None when it does not: the model's own pooling
    (`defaults`: an encoder's sentence-transformers config), else vLLM's default for a
    decoder converted to an embedder (LAST, normalized); --pooler-config over either. A
    generating decoder given a --pooler-config pools too: one replica serves both kinds.
    An encoder always pools."""
    if (config.runner != "pooling" and config.pooler_config is None and not model_config.is_encoder
            and not model_config.labels):
        return None
    # What the head reads: BERT's [CLS], a decoder's last token (vLLM's as_seq_cls_model).
    head = {"pooling_type": "CLS" if model_config.is_encoder else "LAST", "normalize": False} if model_config.labels else {}
    settings = {"pooling_type": "LAST", "normalize": True, **defaults, **head, **config.pooler_overrides}
    return PoolerConfig(hidden_size=model_config.hidden_size, is_matryoshka=model_config.is_matryoshka,
                        labels=model_config.labels, **settings)


def token_type_ids(plan: StepPlan, requests: dict[str, RequestState], device: torch.device) -> torch.Tensor:
    """An encoder's segment of each scheduled token: 0, and 1 from a pair's second text on
    (a cross-encoder's query and document, PoolingParams.second_segment_start)."""
    types = []
    for request_id, count in plan.num_scheduled_tokens.items():
        state = requests[request_id]
        start = state.num_computed_tokens
        boundary = state.sampling_params.pooling.second_segment_start if state.sampling_params.pooling else None
        types += [int(boundary is not None and position >= boundary) for position in range(start, start + count)]
    return torch.tensor(types, dtype=torch.long, device=device)
