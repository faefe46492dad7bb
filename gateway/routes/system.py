"""Operational endpoints: /health for probes, /load for load balancers, /version, /metrics for Prometheus."""
from __future__ import annotations

import asyncio
from importlib.metadata import version

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.context import GatewayContext, get_context

router = APIRouter()


@router.get("/health")
async def health(ctx: GatewayContext = Depends(get_context)) -> Response:
    # Draining, readiness fails at once, so load balancers stop sending requests here.
    return Response(status_code=200 if ctx.is_ready() and not ctx.drain.draining else 503)


@router.get("/load")
async def load(request: Request) -> dict[str, int]:
    # vLLM's shape; 0 unless --enable-server-load-tracking (gateway/server_load.py).
    return {"server_load": request.app.state.server_load.in_flight}


@router.get("/version")
async def get_version() -> dict[str, str]:
    return {"version": version("kvfleet")}


@router.get("/metrics")
async def metrics(ctx: GatewayContext = Depends(get_context)) -> Response:
    # A scrape sees every request that ended before it, of every model the gateway fronts.
    await asyncio.gather(*(model.engine.refresh_stats() for model in (ctx, *ctx.others)))
    return Response(ctx.metrics.render([other.metrics for other in ctx.others]), media_type=CONTENT_TYPE_LATEST)
