"""A scheduler's runtime-loaded LoRA adapters (POST /v1/load_lora_adapter) listed again in
the registry when its lease finds itself re-registered: the registry's adapter hash has no
lease, so a Redis restarted empty forgot them, and gateways resolve adapter names from it
(docs/lora.md). Put only where absent: an entry a gateway wrote since is newer."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.lora_request import encode_lora
from services.registry import Registry

if TYPE_CHECKING:  # as scheduler_svc/main.py: the role's entry imports no engine until it runs one
    from scheduler_svc.engine_core import EngineCore


def reannounce_loras(registry: Registry, core: EngineCore) -> Callable[[], None]:
    """The lease's on_registered for the scheduler of `core`."""
    def announce() -> None:
        for lora in list(core.loaded_loras.values()):  # a copy: loads and unloads come on gRPC threads
            registry.put_lora_if_absent(lora.lora_name, encode_lora(lora))
    return announce
