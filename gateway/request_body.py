"""What every OpenAI request model shares: the bounds that keep a value representable where
it goes, and vLLM's handling of fields a body carries that kvfleet does not know.

Unknown request fields are ignored, as vLLM's server does, so clients that send newer
or vendor-specific fields keep working; like vLLM, each request that carries any logs
them once, at warning level, so a misspelt field does not pass unnoticed. Floats are
finite, seeds and top_k fit torch's int64 and token ids are below 2**31 (what a
tokenizer can decode); text holds no lone UTF-16 surrogate.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, field_validator, model_validator

logger = logging.getLogger(__name__)

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _valid_unicode(value: Any) -> bool:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    if isinstance(value, str):
        # UTF-8 encoding refuses exactly the surrogates, in C: fast on a multi-megabyte prompt.
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, (list, tuple)):
        return all(_valid_unicode(v) for v in value)
    if isinstance(value, dict):
        return all(_valid_unicode(k) and _valid_unicode(v) for k, v in value.items())
    return True


class RequestModel(BaseModel):
    # NaN and infinities pass every range check by comparison rules of their own; refuse them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if not _valid_unicode(value):
            raise ValueError("contains a lone UTF-16 surrogate, which is not valid Unicode text")
        return value


# The most ignored fields one log line names; the rest are counted.
_MAX_IGNORED_NAMED = 20
# Per model class: the key each field is read from (its alias, else its name), and the
# keys of the fields that may hold models of their own, each with its field's name.
_WIRE_KEYS: dict[type[BaseModel], tuple[frozenset[str], dict[str, str]]] = {}


def _holds_models(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_models(arg) for arg in get_args(annotation))


def _wire_keys(cls: type[BaseModel]) -> tuple[frozenset[str], dict[str, str]]:
    keys = _WIRE_KEYS.get(cls)
    if keys is None:
        fields = cls.model_fields.items()
        keys = _WIRE_KEYS[cls] = (frozenset(field.alias or name for name, field in fields),
                                  {field.alias or name: name for name, field in fields if _holds_models(field.annotation)})
    return keys


def _ignored_fields(model: BaseModel, raw: dict[str, Any], path: str = "") -> list[str]:
    """The keys of `raw` that validating it into `model` dropped, nested ones as
    `messages[0].key`, in the body's order. Walks down only the fields that hold models."""
    cls = type(model)
    known, nested = _wire_keys(cls)
    found = [] if cls.model_config.get("extra") == "allow" else [f"{path}{key}" for key in raw if key not in known]
    for key, name in nested.items():
        if (value := raw.get(key)) is None:
            continue
        parsed = getattr(model, name)
        if isinstance(parsed, BaseModel) and isinstance(value, dict):
            found += _ignored_fields(parsed, value, f"{path}{key}.")
        elif isinstance(parsed, list) and isinstance(value, list):
            for index, (item, raw_item) in enumerate(zip(parsed, value)):
                if isinstance(item, BaseModel) and isinstance(raw_item, dict):
                    found += _ignored_fields(item, raw_item, f"{path}{key}[{index}].")
    return found


class Body(RequestModel):
    """A whole request body. Fields it does not know are dropped, and logged once per
    request in vLLM's words."""

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Body]) -> Body:
        body = handler(data)
        if isinstance(data, dict) and (ignored := _ignored_fields(body, data)):
            named = ", ".join(repr(key) for key in ignored[:_MAX_IGNORED_NAMED])
            more = f" and {len(ignored) - _MAX_IGNORED_NAMED} more" if len(ignored) > _MAX_IGNORED_NAMED else ""
            logger.warning("The following fields were present in the request but ignored: {%s}%s", named, more)
        return body
