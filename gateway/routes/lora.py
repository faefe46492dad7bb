"""vLLM's runtime adapter routes, served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True:
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, answered as vLLM
answers them (plain-text success; errors gateway/lora_adapters.py words)."""
from __future__ import annotations

import os

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from gateway.context import GatewayContext, get_context
from gateway.errors import OpenAIError
from gateway.lora_adapters import LoraAdapters

router = APIRouter()


def runtime_lora_updating() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest,
                            ctx: GatewayContext = Depends(get_context)) -> PlainTextResponse:
    await _adapters(ctx).load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              ctx: GatewayContext = Depends(get_context)) -> PlainTextResponse:
    await _adapters(ctx).unload(body.lora_name, body.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _adapters(ctx: GatewayContext) -> LoraAdapters:
    if ctx.loras is None:  # an app built without build_app's adapters
        raise OpenAIError(400, "LoRA is not enabled on this server")
    return ctx.loras
