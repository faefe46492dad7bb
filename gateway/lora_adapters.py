"""The LoRA adapters a gateway serves, by name (docs/lora.md): what `--lora-modules` and
`POST /v1/load_lora_adapter` add, `/v1/unload_lora_adapter` removes, `/v1/models` lists,
and a request's `model` resolves to. vLLM's rules and words: a name is loaded once, each
load gets the next `lora_int_id`, and the engine reads and checks the adapter before the
name is served."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from gateway.errors import OpenAIError
from services.engine_client import EngineClient
from services.lora_request import LoRARequest


@dataclass
class LoraAdapters:
    engine: EngineClient
    _by_name: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name else None

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    async def load(self, name: str | None, path: str | None, base_model_name: str | None = None) -> LoRARequest:
        if not name or not path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.", code="InvalidUserInput")
        async with self._lock:  # two loads of one name: the second is refused, not served twice
            if name in self._by_name:
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name",
                                  "InvalidUserInput")
            lora = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await self.engine.add_lora(lora)
            except ValueError as exc:
                # vLLM's: a path with no adapter is a 404, any other bad adapter a 400.
                status = 404 if "No adapter found" in str(exc) else 400
                raise OpenAIError(status, str(exc), "lora_path",
                                  "NotFoundError" if status == 404 else "BadRequestError") from exc
            self._by_name[name] = lora
            return lora

    async def unload(self, name: str | None, lora_int_id: int | None = None) -> None:
        if not name and not lora_int_id:
            raise OpenAIError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.",
                              code="InvalidUserInput")
        async with self._lock:
            lora = self._by_name.get(name) if name else next(
                (lora for lora in self._by_name.values() if lora.lora_int_id == lora_int_id), None)
            if lora is None:
                raise OpenAIError(404, f"The lora adapter '{name or lora_int_id}' cannot be found.", "lora_name",
                                  "NotFoundError")
            del self._by_name[lora.lora_name]
            await self.engine.remove_lora(lora.lora_int_id)
