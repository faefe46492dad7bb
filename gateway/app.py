"""The gateway's FastAPI app: OpenAI routes over any EngineClient.

The app does not start or stop the engine client: whoever builds the client owns its
lifecycle (`kvfleet serve`, a test), so one client can serve several apps. Nor does it
drain by itself: gateway.drain.serve runs it so. ServerOptions add vLLM's optional
server routes and behaviours (--root-path, /tokenizer_info, /load's counting).
"""
from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from gateway.auth import ApiKeyMiddleware
from gateway.context import GatewayContext
from gateway.drain import DrainMiddleware
from gateway.errors import install_error_handlers
from gateway.limits import BodySizeMiddleware, RequestLimits
from gateway.lora_adapters import LoraAdapters
from gateway.metrics import GatewayMetrics
from gateway.model_router import ModelRouter
from gateway.response_options import ResponseOptions
from gateway.routes import (
    chat,
    classify,
    completions,
    embeddings,
    lora,
    models,
    sagemaker,
    scoring,
    system,
    tokenize,
    tokenizer_info,
)
from gateway.routes.lora import runtime_lora_updating
from gateway.server_load import ServerLoad, ServerLoadMiddleware
from gateway.server_options import ServerOptions
from gateway.tool_calls import ChatOptions
from services.engine_client import EngineClient
from services.tokenizer_api import PromptEncoder


def build_app(
    engine_client: EngineClient,
    encoder: PromptEncoder,
    served_model_names: str | Sequence[str],
    api_key: str | None = None,
    limits: RequestLimits = RequestLimits(),
    chat_options: ChatOptions = ChatOptions(),
    options: ResponseOptions = ResponseOptions(),
    model: str | None = None,
    server: ServerOptions = ServerOptions(),
    extra_models: Sequence[FastAPI] = (),
) -> FastAPI:
    """`encoder` does the text work: in-process, or the cluster's tokenizer role.
    Clients may name any of `served_model_names`; responses carry the first, as in vLLM.
    `model`: the model as the server was started with it (default: the first served name).
    `extra_models`: other models' apps (built by this function), which answer the requests
    naming them (gateway/model_router.py)."""
    names = (served_model_names,) if isinstance(served_model_names, str) else tuple(served_model_names)
    app = FastAPI(title="kvfleet")
    app.root_path = server.root_path  # set as an attribute: the constructor's argument is deprecated
    app.state.gateway = GatewayContext(
        engine=engine_client,
        encoder=encoder,
        served_model_names=names,
        metrics=GatewayMetrics(engine_client, names[0]),
        limits=limits,
        model=model or names[0],
        chat_options=chat_options,
        options=options,
        loras=LoraAdapters(engine_client),
        others=tuple(extra.state.gateway for extra in extra_models),
    )
    for module in (models, completions, chat, embeddings, classify, scoring, tokenize, system, sagemaker):
        app.include_router(module.router)
    if server.tokenizer_info:
        app.include_router(tokenizer_info.router)
    if runtime_lora_updating():
        app.include_router(lora.router)
    install_error_handlers(app)
    if extra_models:  # first, so innermost: the middlewares below guard every model's requests
        app.add_middleware(ModelRouter, apps={name: extra for extra in extra_models
                                              for name in extra.state.gateway.served_model_names})
    app.state.server_load = ServerLoad()
    if server.load_tracking:  # innermost: requests the key refused are not counted
        app.add_middleware(ServerLoadMiddleware, load=app.state.server_load)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeMiddleware, max_bytes=limits.max_request_body_bytes)
    # Added last, so outermost: it counts every request in flight, whatever answers it.
    app.add_middleware(DrainMiddleware, drain=app.state.gateway.drain)
    return app
