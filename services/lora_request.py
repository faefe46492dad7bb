"""vLLM's LoRARequest: which adapter a request runs with. It travels with the request from
the front end to the worker, which loads the adapter from `lora_path` when it first meets
`lora_int_id` (or again after its caches evicted it)."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    lora_name: str
    # Unique per adapter in one server: the worker's caches and the prefix cache key on it.
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:  # as vLLM: 0 means "no adapter" in its engine
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


def encode_lora(lora_request: LoRARequest) -> str:
    """As the registry lists an adapter (JSON), for every gateway to read."""
    return msgspec.json.encode(lora_request).decode()
