"""GET /v1/models: the model this server serves, under each of its served names."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from gateway.context import GatewayContext, get_context
from gateway.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: GatewayContext = Depends(get_context)) -> ModelList:
    return ModelList(data=[ModelCard(id=name, root=ctx.model, max_model_len=ctx.max_model_len)
                           for name in ctx.served_model_names])
