"""What the pooling endpoints share: their inputs to token ids, checked, and a batch of
pooling requests through the engine (docs/pooling.md)."""
from __future__ import annotations

import time

from gateway.context import GatewayContext
from gateway.errors import bad_request
from gateway.generation import prime_all
from gateway.pooling_protocol import _PoolingInputs
from services.engine_client import RequestFailed
from services.pooling_outputs import fit_pooling_prompt
from services.pooling_params import PoolingParams
from services.sampling_params import SamplingParams


def check_pools(ctx: GatewayContext, api: str) -> None:
    """vLLM's answer when the model serves no pooling."""
    if ctx.pooler is None:
        raise bad_request(None, f"The model does not support {api} API")


async def token_lists(ctx: GatewayContext, prompts: str | list[str] | list[int] | list[list[int]],
                      add_special_tokens: bool, truncate_prompt_tokens: int | None) -> list[list[int]]:
    """Each input as the token ids the model sees: cut to truncate_prompt_tokens, refused past its positions."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise bad_request("input", "input must not be empty")
    if isinstance(prompts[0], int):
        prompts = [prompts]
    if isinstance(prompts[0], str):
        lists = await ctx.encoder.encode(prompts, add_special_tokens=add_special_tokens)
    else:
        lists = [list(ids) for ids in prompts]
    ctx.limits.check_fan_out(len(lists), 1, "input")
    if not all(lists):  # a text of no tokens (a model that adds none)
        raise bad_request("input", "The decoder prompt cannot be empty")
    return [fit_pooling_prompt(ids, truncate_prompt_tokens, ctx.max_model_len) for ids in lists]


async def pooling_inputs(ctx: GatewayContext, body: _PoolingInputs, api: str,
                         dimensions: int | None = None) -> list[list[int]]:
    """A request that pools each of its inputs: checked against this model (with the
    vector length it asks for), as token ids."""
    ctx.check_model(body.model)
    ctx.check_ready()
    check_pools(ctx, api)
    check_dimensions(ctx, dimensions)
    return await token_lists(ctx, body.input, body.add_special_tokens, body.truncate_prompt_tokens)


def check_dimensions(ctx: GatewayContext, dimensions: int | None) -> None:
    """vLLM's rules: only a Matryoshka model's vectors may be cut, and never past their length."""
    if dimensions is None:
        return
    pooler = ctx.pooler
    if not pooler.is_matryoshka:
        raise bad_request("dimensions", f'Model "{ctx.served_model_name}" does not support matryoshka '
                          "representation, changing output dimensions will lead to poor results.")
    if not 1 <= dimensions <= pooler.hidden_size:
        raise bad_request("dimensions", f"dimensions must be in [1, {pooler.hidden_size}], got {dimensions}")


async def pool(ctx: GatewayContext, request_id: str, lists: list[list[int]],
               params: PoolingParams | list[PoolingParams]) -> list[list[float]]:
    """One vector per token list (with its own params, or all with the same), all submitted
    at once so the engine batches them."""
    each = params if isinstance(params, list) else [params] * len(lists)
    started = time.perf_counter()
    # Shortest first (the engine takes them in this order): an encoder's steps then hold
    # sequences of like lengths, which its attention pads less.
    order = sorted(range(len(lists)), key=lambda i: len(lists[i]))
    streams = await prime_all([ctx.engine.generate(f"{request_id}-{i}", lists[i], SamplingParams(pooling=each[i]))
                               for i in order])
    try:
        arrived = [await anext(stream) for stream in streams]
    finally:
        for stream in streams:
            await stream.aclose()
    deltas = [delta for _, delta in sorted(zip(order, arrived))]
    for delta in deltas:
        if delta.pooled is None:
            raise RequestFailed(delta.request_id, delta.error or f"ended ({delta.finish_reason}) without a vector")
    for ids in lists:
        ctx.metrics.pooled(len(ids), time.perf_counter() - started)
    return [delta.pooled for delta in deltas]

