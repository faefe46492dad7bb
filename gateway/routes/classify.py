"""POST /classify and /pooling: vLLM's APIs for a classifier's label scores and for the
pooler's raw output (docs/pooling.md)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.json_body import OffLoopJsonRoute
from gateway.pooling import pool, pooling_inputs
from gateway.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
)
from gateway.routes.embeddings import encoded
from services.pooling_params import PoolingParams

router = APIRouter(route_class=OffLoopJsonRoute)


@router.post("/classify")
async def create_classify(body: ClassificationRequest, request: Request,
                          ctx: GatewayContext = Depends(get_context)) -> Response:
    return await cancel_on_disconnect(request, _classify(body, ctx))


async def _classify(body: ClassificationRequest, ctx: GatewayContext) -> Response:
    lists = await pooling_inputs(ctx, body, "Classification")
    labels = ctx.pooler.labels
    if not labels:
        raise bad_request(None, "The model does not support Classification API")
    scores = await pool(ctx, f"classify-{uuid.uuid4().hex}", lists, PoolingParams(use_activation=body.use_activation))
    data = [ClassificationData(index=i, label=labels[max(range(len(probs)), key=probs.__getitem__)], probs=probs,
                               num_classes=len(probs)) for i, probs in enumerate(scores)]
    response = ClassificationResponse(model=ctx.served_model_name, data=data, usage=PoolingUsage.of(sum(map(len, lists))))
    return Response(response.model_dump_json(), media_type="application/json")


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request, ctx: GatewayContext = Depends(get_context)) -> Response:
    return await cancel_on_disconnect(request, _pooling(body, ctx))


async def _pooling(body: PoolingRequest, ctx: GatewayContext) -> Response:
    lists = await pooling_inputs(ctx, body, "Pooling")
    vectors = await pool(ctx, f"pool-{uuid.uuid4().hex}", lists, PoolingParams(body.normalize, body.dimensions))
    response = PoolingResponse(model=ctx.served_model_name,
                               data=[PoolingData(index=i, data=encoded(v, body.encoding_format))
                                     for i, v in enumerate(vectors)],
                               usage=PoolingUsage.of(sum(map(len, lists))))
    return Response(response.model_dump_json(), media_type="application/json")
