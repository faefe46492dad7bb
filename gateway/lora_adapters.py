"""The LoRA adapters a gateway serves, by name (docs/lora.md): what `--lora-modules` and
`POST /v1/load_lora_adapter` add, `/v1/unload_lora_adapter` removes, `/v1/models` lists,
and a request's `model` resolves to. vLLM's rules and words: a name is loaded once, each
load gets a `lora_int_id`, and the engine reads and checks the adapter before the
name is served. The id is a hash of the name and path, so every gateway of a cluster gives
an adapter the same one; a cluster's adapters loaded through other gateways come from the
engine client (`lora_requests()`, the registry's)."""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from gateway.errors import OpenAIError
from services.engine_client import EngineClient
from services.lora_request import LoRARequest


@dataclass
class LoraAdapters:
    engine: EngineClient
    _by_name: dict[str, LoRARequest] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._known().get(name) if name else None

    def all(self) -> list[LoRARequest]:
        return list(self._known().values())

    def _known(self) -> dict[str, LoRARequest]:
        return {**self.engine.lora_requests(), **self._by_name}

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serves an adapter checked elsewhere (a cluster's --lora-modules, by `cluster up`):
        each replica reads it from `path` when a request first names it."""
        self._by_name[name] = lora = LoRARequest(name, lora_int_id(name, path), path, base_model_name)
        return lora

    async def load(self, name: str | None, path: str | None, base_model_name: str | None = None) -> LoRARequest:
        if not name or not path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.", code="InvalidUserInput")
        async with self._lock:  # two loads of one name: the second is refused, not served twice
            if name in self._known():
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name",
                                  "InvalidUserInput")
            lora = LoRARequest(name, lora_int_id(name, path), path, base_model_name)
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
            lora = self._known().get(name) if name else next(
                (lora for lora in self._known().values() if lora.lora_int_id == lora_int_id), None)
            if lora is None:
                raise OpenAIError(404, f"The lora adapter '{name or lora_int_id}' cannot be found.", "lora_name",
                                  "NotFoundError")
            self._by_name.pop(lora.lora_name, None)
            await self.engine.remove_lora(lora.lora_int_id)


def lora_int_id(name: str, path: str) -> int:
    """A positive id the same in every process for the same adapter (56 bits: no collision in practice)."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{path}".encode()).digest()[:7], "big") + 1
