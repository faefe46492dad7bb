"""The gateway's FastAPI app: OpenAI routes over any EngineClient.

The app does not start or stop the engine client: whoever builds the client owns its
lifecycle (`kvfleet serve`, a test), so one client can serve several apps. Nor does it
drain by itself: gateway.drain.serve runs it so.
"""
from __future__ import annotations

from fastapi import FastAPI

from gateway.auth import ApiKeyMiddleware
from gateway.context import GatewayContext
from gateway.drain import DrainMiddleware
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.routes import chat, completions, models, system, tokenize
from services.engine_client import EngineClient
from tokenizer_svc.tokenizer import Tokenizer


def build_app(
    engine_client: EngineClient,
    tokenizer: Tokenizer,
    served_model_name: str,
    api_key: str | None = None,
    *,
    max_model_len: int,
    eos_token_ids: tuple[int, ...] | None = None,
) -> FastAPI:
    """`eos_token_ids`: the engine's (a model may have several); by default the tokenizer's."""
    if eos_token_ids is None:
        eos_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    app = FastAPI(title="kvfleet")
    app.state.gateway = GatewayContext(
        engine=engine_client,
        tokenizer=tokenizer,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        metrics=GatewayMetrics(engine_client, served_model_name),
    )
    for module in (models, completions, chat, tokenize, system):
        app.include_router(module.router)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    # Added last, so outermost: it counts every request in flight, whatever answers it.
    app.add_middleware(DrainMiddleware, drain=app.state.gateway.drain)
    return app
