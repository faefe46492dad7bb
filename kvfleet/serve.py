"""`kvfleet serve` in embedded mode: engine, tokenizer and gateway in one process.

Whatever can be checked is checked before anything loads, each failure a ConfigError
(one line, exit 2): the flags' values, the port or --uds socket (bound first, as vLLM
does; a socket file left by a server that died is removed then), the model's files and
metadata against the flags, then the device."""
from __future__ import annotations

import argparse
import asyncio
import gc
from typing import TYPE_CHECKING

from gateway.drain import serve
from gateway.listener import listen, release
from services.cli_args import engine_args
from services.config import ConfigError, EngineConfig
from services.lora_modules import LoRAModulePath
from services.telemetry import configure_logging
from worker_svc.runtime.preflight import check_device, check_model

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvfleet.async_engine import AsyncEngine


def serve_embedded(args: argparse.Namespace) -> None:
    """Serves until SIGTERM or SIGINT, then drains (gateway/drain.py) and returns."""
    configure_logging()  # uvicorn configures only its own loggers
    config = EngineConfig(**engine_args(args))
    listener = listen(args)
    app, engine = embedded_app(args, config)
    engine.start()
    try:
        serve(app, listener, args.shutdown_timeout, args.uvicorn_log_level, not args.disable_uvicorn_access_log)
    finally:
        engine.shutdown()
        release(listener, args.uds)


def embedded_app(args: argparse.Namespace, config: EngineConfig) -> tuple[FastAPI, AsyncEngine]:
    """The gateway's app over an engine and a tokenizer in this process, as `serve`'s
    flags set them up: what `kvfleet serve` serves and `kvfleet run-batch` answers its
    lines with. The model and device are checked first; the engine is not started."""
    lora_modules = getattr(args, "lora_modules", None) or []
    if lora_modules and not config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    check_model(config)
    check_device(config)
    # The engine's modules load torch and transformers (seconds): only once the checks above pass.
    from gateway.app import build_app
    from gateway.limits import RequestLimits
    from gateway.response_options import ResponseOptions
    from gateway.server_options import ServerOptions
    from gateway.tool_calls import ChatOptions
    from kvfleet.async_engine import AsyncEngine
    from scheduler_svc.engine_core import EngineCore
    from tokenizer_svc.in_process import InProcessEncoder
    from tokenizer_svc.tokenizer import Tokenizer
    from worker_svc.kernels.cpu.threads import configure_torch_threads
    from worker_svc.worker_group import start_worker

    configure_torch_threads()
    encoder = InProcessEncoder(Tokenizer.for_engine(config, args.chat_template))
    engine = AsyncEngine(EngineCore(config, start_worker(config)))
    app = build_app(engine, encoder, args.served_model_name or [config.model], args.api_key,
                    RequestLimits.from_args(args), ChatOptions.from_args(args), ResponseOptions.from_args(args),
                    config.model, ServerOptions.from_args(args))
    load_lora_modules(app, lora_modules)
    # The model's, tokenizer's and libraries' objects live as long as the process: kept out
    # of every collection, a full one (a large request's allocations set it off) stays
    # short instead of stalling the event loop, /health included, for a third of a second.
    gc.freeze()
    return app, engine


def load_lora_modules(app: FastAPI, modules: list[LoRAModulePath]) -> None:
    """--lora-modules, read and checked before the server listens: a bad one stops it by name."""
    from gateway.errors import OpenAIError

    for module in modules:
        try:
            asyncio.run(app.state.gateway.loras.load(module.name, module.path, module.base_model_name))
        except OpenAIError as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc.message}") from exc
