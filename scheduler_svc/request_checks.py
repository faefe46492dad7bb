"""What the scheduler checks of a request: at admission, whether it can run here at
all (a 400 naming the field otherwise); after each token, whether it stops."""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.request import FinishReason, Request
from services.invalid_parameter import InvalidParameter

if TYPE_CHECKING:
    from scheduler_svc.scheduler import SchedulerConfig


def check_request(request: Request, config: SchedulerConfig, in_use: bool) -> None:
    """At admission: InvalidParameter naming what makes `request` unable to run here."""
    prompt_len = len(request.prompt_token_ids)
    limit = config.max_model_len
    if in_use:
        raise InvalidParameter("request_id", f"{request.request_id!r} is already in use")
    if prompt_len == 0:
        raise InvalidParameter("prompt", "The decoder prompt cannot be empty")  # vLLM's words
    if prompt_len > limit:
        raise InvalidParameter(
            "prompt",
            f"the prompt is {prompt_len} tokens long, more than the maximum model length of {limit}",
        )
    if request.sampling_params.pooling is not None and config.pooler is None:
        raise InvalidParameter("pooling", "this model does not pool: serve it with --runner pooling "
                               "(or --convert embed, or a --pooler-config)")
    if request.sampling_params.pooling is None and not config.generates:
        raise InvalidParameter("prompt", "this model is served for pooling (--runner pooling): it generates no "
                               "text; ask /v1/embeddings")
    resumed = len(request.output_token_ids)
    max_tokens = request.sampling_params.max_tokens
    if resumed and (prompt_len + resumed >= limit or (max_tokens is not None and resumed >= max_tokens)):
        raise InvalidParameter("output_token_ids", f"{resumed} tokens resumed leave nothing to generate")
    vocab = config.vocab_size
    for param in ("logprobs", "prompt_logprobs"):
        wanted = getattr(request.sampling_params, param)
        if wanted is not None and wanted > vocab:
            raise InvalidParameter(param, f"asks for {wanted} tokens, more than the vocabulary's {vocab}")
    named = {"prompt": request.prompt_token_ids, "output_token_ids": request.output_token_ids,
             "logit_bias": list(request.sampling_params.logit_bias or {}),
             "allowed_token_ids": request.sampling_params.allowed_token_ids or [],
             "stop_token_ids": request.sampling_params.stop_token_ids}
    for param, token_ids in named.items():
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad and param == "prompt":  # vLLM's words, which clients match on
            raise InvalidParameter(param, f"Token id {max(bad)} is out of vocabulary (vocabulary size: {vocab})")
        if bad:
            raise InvalidParameter(
                param, f"token_id(s) {bad[:5]} in {param} contain out-of-vocab token ids. Vocabulary size: {vocab}"
            )


def stop_reason(request: Request, token: int, max_model_len: int) -> FinishReason | None:
    """After each token: why `request` ends with `token`, or None while it goes on."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            request.stop_reason = token
            return FinishReason.STOP
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
