"""`kvfleet serve` in embedded mode: engine, tokenizer and gateway in one process."""
from __future__ import annotations

from typing import Any

from gateway.app import build_app
from gateway.drain import serve
from services.async_engine import AsyncEngine
from services.config import EngineConfig
from services.engine import EngineCore
from services.model_source import resolve_model
from services.telemetry import configure_logging
from services.threads import configure_torch_threads
from tokenizer_svc.tokenizer import Tokenizer


def serve_embedded(
    engine_args: dict[str, Any],
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    shutdown_timeout_s: float = 30.0,
) -> None:
    """Serves until SIGTERM or SIGINT, then drains (gateway/drain.py) and returns."""
    configure_logging()  # uvicorn configures only its own loggers
    configure_torch_threads()
    config = EngineConfig(**engine_args)
    tokenizer = Tokenizer.load(resolve_model(config.model))
    core = EngineCore(config, fallback_eos_token_id=tokenizer.eos_token_id)
    engine = AsyncEngine(core)
    app = build_app(
        engine, tokenizer, served_model_name or config.model, api_key, max_model_len=core.max_model_len,
        eos_token_ids=core.eos_token_ids,
    )
    engine.start()
    try:
        serve(app, host, port, shutdown_timeout_s)
    finally:
        engine.shutdown()
