"""POST /v1/embeddings: OpenAI's embeddings API (with vLLM's extra parameters) over the
pooling runner (docs/pooling.md)."""
from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.json_body import OffLoopJsonRoute
from gateway.pooling import pool, pooling_inputs
from gateway.pooling_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingUsage
from services.pooling_params import PoolingParams

router = APIRouter(route_class=OffLoopJsonRoute)


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request,
                           ctx: GatewayContext = Depends(get_context)) -> Response:
    return await cancel_on_disconnect(request, _embed(body, ctx))


async def _embed(body: EmbeddingRequest, ctx: GatewayContext) -> Response:
    lists = await pooling_inputs(ctx, body, "Embeddings", body.dimensions)
    vectors = await pool(ctx, f"embd-{uuid.uuid4().hex}", lists, PoolingParams(body.normalize, body.dimensions))
    data = [EmbeddingData(index=i, embedding=encoded(vector, body.encoding_format)) for i, vector in enumerate(vectors)]
    response = EmbeddingResponse(model=ctx.served_model_name, data=data, usage=PoolingUsage.of(sum(map(len, lists))))
    return Response(response.model_dump_json(), media_type="application/json")


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64: the float32 values' little-endian bytes, as OpenAI's clients decode them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
