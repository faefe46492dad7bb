"""`kvfleet serve` in embedded mode: engine, tokenizer and gateway in one process."""
from __future__ import annotations

from typing import Any

from gateway.app import build_app
from gateway.drain import serve
from gateway.limits import RequestLimits
from gateway.tool_calls import ChatOptions
from scheduler_svc.async_engine import AsyncEngine
from scheduler_svc.engine_core import EngineCore
from services.config import EngineConfig
from services.model_source import resolve_model
from services.telemetry import configure_logging
from tokenizer_svc.in_process import InProcessEncoder
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.threads import configure_torch_threads
from worker_svc.worker import Worker


def serve_embedded(
    engine_args: dict[str, Any],
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    shutdown_timeout_s: float,
    limits: RequestLimits,
    chat_options: ChatOptions,
) -> None:
    """Serves until SIGTERM or SIGINT, then drains (gateway/drain.py) and returns."""
    configure_logging()  # uvicorn configures only its own loggers
    configure_torch_threads()
    config = EngineConfig(**engine_args)
    encoder = InProcessEncoder(Tokenizer.load(resolve_model(config.model)))
    engine = AsyncEngine(EngineCore(config, Worker(config)))
    app = build_app(engine, encoder, served_model_name or config.model, api_key, limits, chat_options)
    engine.start()
    try:
        serve(app, host, port, shutdown_timeout_s)
    finally:
        engine.shutdown()
