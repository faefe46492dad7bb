"""vLLM's GET /tokenizer_info, served with --enable-tokenizer-info-endpoint: the
tokenizer's configuration (tokenizer_svc/tokenizer.py's Tokenizer.info), which shows
its chat template, hence off by default."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.context import GatewayContext, get_context

router = APIRouter()


@router.get("/tokenizer_info")
async def tokenizer_info(ctx: GatewayContext = Depends(get_context)) -> dict[str, Any]:
    return ctx.tokenizer.info()
