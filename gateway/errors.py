"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Clients (the openai SDK included) pick the exception class from the status code and
show `message`; `param` names the request field at fault.
"""
from __future__ import annotations

import logging
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.responses import ErrorInfo, ErrorResponse
from services.engine_client import EngineOverloaded, EngineUnavailable, RequestFailed, RequestLost
from services.invalid_parameter import InvalidParameter

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}
# A body's validation errors, each with its input cut short as pydantic cuts it: a
# multi-megabyte prompt must not come back in the message.
_MAX_ERRORS_SHOWN = 10
_INPUT_REPR = reprlib.Repr()
_INPUT_REPR.maxstring = _INPUT_REPR.maxother = 50


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status)


def error_for(exc: Exception) -> OpenAIError:
    """The OpenAI error an exception raised while serving a request stands for."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidParameter):
        return OpenAIError(400, str(exc), exc.param)
    if isinstance(exc, ValueError):  # the engine's other input checks
        return OpenAIError(400, str(exc))
    if isinstance(exc, EngineOverloaded):
        return OpenAIError(429, str(exc))
    if isinstance(exc, (EngineUnavailable, RequestLost)):
        return OpenAIError(503, str(exc))
    if isinstance(exc, RequestFailed):
        return OpenAIError(500, str(exc))
    logger.exception("unexpected error", exc_info=exc)
    return OpenAIError(500, f"internal error: {exc!r}")


def _validation_param(error: dict) -> str | None:
    # FastAPI's loc is ("body", field, ...); the top-level field is what OpenAI's
    # `param` names. A body that is not JSON at all has no field.
    loc = [part for part in error.get("loc", ()) if part != "body"]
    return str(loc[0]) if loc and isinstance(loc[0], str) else None


def _validation_message(error: dict) -> str:
    """One error in pydantic's own words (`... [type=less_than_equal, input_value=..., input_type=int]`),
    which vLLM's server passes on and its clients match on, after the field's path."""
    where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
    message = error.get("msg", "invalid request")
    if "type" in error:
        value = error.get("input")
        message += f" [type={error['type']}, input_value={_INPUT_REPR.repr(value)}, input_type={type(value).__name__}]"
    return f"{where}: {message}" if where else message


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    param = _validation_param(errors[0]) if errors else None
    shown = [_validation_message(error) for error in errors[:_MAX_ERRORS_SHOWN]]
    more = f"; and {len(errors) - _MAX_ERRORS_SHOWN} more" if len(errors) > _MAX_ERRORS_SHOWN else ""
    return error_response(400, "; ".join(shown) + more if shown else "invalid request", param)


async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    error = error_for(exc)
    response = error_response(error.status, error.message, error.param, error.code)
    if isinstance(exc, EngineOverloaded):
        response.headers["Retry-After"] = str(exc.retry_after_s)
        request.app.state.gateway.metrics.requests_rejected.inc()
    if not isinstance(exc, (OpenAIError, ValueError, EngineUnavailable, RequestFailed)):
        # A bug: Starlette re-raises it after this response, and the server then drops the
        # connection. Saying so keeps a keep-alive client from sending its next request into it.
        response.headers["Connection"] = "close"
    return response


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    for handled in (OpenAIError, ValueError, EngineUnavailable, RequestFailed):
        app.add_exception_handler(handled, _on_error)
    # Anything else is a bug: still answered in OpenAI's shape, and logged by the server.
    app.add_exception_handler(Exception, _on_error)
