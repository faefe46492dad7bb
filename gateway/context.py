"""What every endpoint of one app shares: the engine client, the prompt encoder, model
name, metrics, and the shutdown state. What the engine and the tokenizer tell about
themselves (context length, EOS, the decoding tokenizer) may arrive after the app
starts listening (a cluster still loading): until then the requests that need it get 503."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import msgspec
from fastapi import Request

from gateway.beam import beam_choices
from gateway.choices import ChoiceDelta, generate_choices
from gateway.drain import Drain
from gateway.errors import OpenAIError, bad_request
from gateway.limits import RequestLimits
from gateway.lora_adapters import LoraAdapters
from gateway.metrics import GatewayMetrics
from gateway.protocol import SamplingFields
from gateway.response_options import ResponseOptions
from gateway.tool_calls import ChatOptions
from services.engine_client import EngineClient
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import EngineInfo
from services.pooling_params import PoolerConfig
from services.sampling_params import SamplingParams
from services.tokenizer_api import PromptEncoder
from tokenizer_svc.tokenizer import Tokenizer


@dataclass
class GatewayContext:
    engine: EngineClient
    encoder: PromptEncoder
    served_model_names: tuple[str, ...]
    metrics: GatewayMetrics
    limits: RequestLimits
    model: str  # the model as the server was started with it (vLLM's --model): /v1/models' root
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    options: ResponseOptions = field(default_factory=ResponseOptions)
    drain: Drain = field(default_factory=Drain)  # set on SIGTERM by gateway.drain.serve
    loras: LoraAdapters | None = None  # the LoRA adapters served (docs/lora.md); set by build_app
    # The other models this gateway fronts (gateway/model_router.py), each with its own engine and tokenizer.
    others: tuple[GatewayContext, ...] = ()
    every_model_served: bool = field(default=False, init=False)  # every one could serve at once, some time

    @property
    def served_model_name(self) -> str:
        """The name responses carry."""
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the gateway detokenizes with."""
        if not self.encoder.is_started():
            raise OpenAIError(503, "the tokenizer service is not ready")
        return self.encoder.decoder

    @property
    def vocab_size(self) -> int:
        """What a logprob count of -1 stands for: every token."""
        return self.tokenizer.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._engine_info().max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """What ends a beam in beam search."""
        return self._engine_info().eos_token_ids

    @property
    def pooler(self) -> PoolerConfig | None:
        """How the engine pools; None when it serves no pooling (docs/pooling.md)."""
        return self._engine_info().pooler

    def _engine_info(self) -> EngineInfo:
        info = self.engine.engine_info()
        if info is None:
            raise OpenAIError(503, "the engine is not ready")
        return info

    def check_model(self, model: str | None) -> None:
        # Like vLLM, a request that names no model (absent, null or "") gets the served one.
        if model and model not in self.served_model_names and self.lora(model) is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def lora(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        return self.loras.get(model) if self.loras is not None else None

    def response_model(self, model: str | None) -> str:
        """The name a response carries: the adapter's when the request named one, as vLLM."""
        return model if self.lora(model) is not None else self.served_model_name

    def is_ready(self) -> bool:
        """Every model it fronts can serve; once every one could, any of them: one model's
        outage must not take the gateway, and the other models' traffic, out of a load
        balancer (that model's requests get a 503 naming what is missing)."""
        serving = [model.can_serve() for model in (self, *self.others)]
        self.every_model_served |= all(serving)
        return all(serving) or (self.every_model_served and any(serving))

    def can_serve(self) -> bool:
        """This model's replicas and tokenizer are there."""
        return self.engine.is_ready() and self.encoder.is_ready() and self.engine.engine_info() is not None

    def check_ready(self) -> None:
        if not self.engine.is_ready():
            raise OpenAIError(503, "the engine is not ready")
        if not self.encoder.is_started():  # a started one away for a while is waited for
            raise OpenAIError(503, "the tokenizer service is not ready")

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, body: SamplingFields
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """The request's choices: sampled, or the best beams when the body asks for beam search."""
        if body.use_beam_search:
            return beam_choices(
                self.engine, self.tokenizer, self.metrics, request_id, prompt_token_ids, params, body.length_penalty,
                self.eos_token_ids, self.max_model_len, body.cache_salt, self.lora(body.model),
            )
        return generate_choices(
            self.engine, self.tokenizer, self.metrics, request_id, prompt_token_ids, params, body.cache_salt,
            _kv_transfer_params(body), self.lora(body.model),
        )


def _kv_transfer_params(body: SamplingFields) -> KvTransferParams | None:
    """vLLM's kv_transfer_params of the body, checked (docs/disaggregation.md)."""
    if body.kv_transfer_params is None:
        return None
    try:
        return msgspec.convert(body.kv_transfer_params, KvTransferParams)
    except msgspec.ValidationError as exc:
        raise bad_request("kv_transfer_params", f"kv_transfer_params: {exc}") from exc


def get_context(request: Request) -> GatewayContext:
    """FastAPI dependency: the context of the app serving this request."""
    return request.app.state.gateway
