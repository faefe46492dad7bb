"""GET /v1/models: the models this server serves, each under each of its served names, and the LoRA adapters."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from gateway.context import GatewayContext, get_context
from gateway.responses import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: GatewayContext = Depends(get_context)) -> ModelList:
    cards = [ModelCard(id=name, root=ctx.model, max_model_len=ctx.max_model_len) for name in ctx.served_model_names]
    # vLLM's adapter cards: root the adapter's path, parent the base model's served name.
    cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or ctx.served_model_name,
                        max_model_len=ctx.max_model_len) for lora in (ctx.loras.all() if ctx.loras else [])]
    # The other models a gateway fronts (--extra-model), once their replicas are known.
    cards += [ModelCard(id=name, root=other.model, max_model_len=other.max_model_len)
              for other in ctx.others if other.engine.engine_info() is not None for name in other.served_model_names]
    return ModelList(data=cards)
