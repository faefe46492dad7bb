"""/score and /rerank's common part: text pairs to scores, by a cross-encoder's head or
by an embedding model's cosine (services/scoring.py), batched in one go (docs/pooling.md)."""
from __future__ import annotations

import uuid

from gateway.context import GatewayContext
from gateway.errors import bad_request
from gateway.pooling import check_pools, pool
from services.pooling_outputs import fit_pooling_prompt
from services.pooling_params import PoolingParams
from services.scoring import cosine, pair_prompt


async def score_pairs(ctx: GatewayContext, firsts: list[str], seconds: list[str], truncate_prompt_tokens: int | None,
                      use_activation: bool | None, api: str) -> tuple[list[float], int]:
    """Each pair's score, and the prompt tokens they took."""
    ctx.check_ready()
    check_pools(ctx, api)
    ctx.limits.check_fan_out(len(seconds), 1, "text_2")
    request_id = f"score-{uuid.uuid4().hex}"
    labels = ctx.pooler.labels
    if labels:
        if len(labels) != 1:
            raise bad_request(None, f"{api} needs a cross-encoder with one label; this model has {len(labels)}: "
                              "use /classify")
        encoded = await ctx.encoder.encode(firsts + seconds)
        pairs = [pair_prompt(a, b) for a, b in zip(encoded[:len(firsts)], encoded[len(firsts):])]
        lists = [fit_pooling_prompt(ids, truncate_prompt_tokens, ctx.max_model_len) for ids, _ in pairs]
        params = [PoolingParams(second_segment_start=start, use_activation=use_activation) for _, start in pairs]
        vectors = await pool(ctx, request_id, lists, params)
        return [vector[0] for vector in vectors], sum(map(len, lists))
    texts = list(dict.fromkeys(firsts + seconds))  # each distinct text embedded once
    lists = [fit_pooling_prompt(ids, truncate_prompt_tokens, ctx.max_model_len)
             for ids in await ctx.encoder.encode(texts)]
    vectors = dict(zip(texts, await pool(ctx, request_id, lists, PoolingParams())))
    return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, seconds)], sum(map(len, lists))
