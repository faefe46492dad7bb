"""What every endpoint of one app shares: the engine client, tokenizer, model name, metrics,
and the shutdown state."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from fastapi import Request

from gateway.beam import beam_choices
from gateway.choices import ChoiceDelta, generate_choices
from gateway.drain import Drain
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics
from gateway.protocol import SamplingFields
from services.engine_client import EngineClient
from services.sampling_params import SamplingParams
from tokenizer_svc.tokenizer import Tokenizer


@dataclass
class GatewayContext:
    engine: EngineClient
    tokenizer: Tokenizer
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # what ends a beam in beam search
    metrics: GatewayMetrics
    drain: Drain = field(default_factory=Drain)  # set on SIGTERM by gateway.drain.serve

    def check_model(self, model: str | None) -> None:
        # Like vLLM, a request that names no model gets the served one.
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_ready():
            raise OpenAIError(503, "the engine is not ready")

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, body: SamplingFields
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """The request's choices: sampled, or the best beams when the body asks for beam search."""
        if body.use_beam_search:
            return beam_choices(
                self.engine, self.tokenizer, self.metrics, request_id, prompt_token_ids, params, body.length_penalty,
                self.eos_token_ids, self.max_model_len, body.cache_salt,
            )
        return generate_choices(
            self.engine, self.tokenizer, self.metrics, request_id, prompt_token_ids, params, body.cache_salt
        )


def get_context(request: Request) -> GatewayContext:
    """FastAPI dependency: the context of the app serving this request."""
    return request.app.state.gateway
