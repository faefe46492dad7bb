"""A LoRA adapter's load or unload on every replica at once (docs/lora.md): each scheduler
has its worker read and check it. A refusal is the adapter's fault (ValueError, the
worker's words); a replica that cannot answer makes the load fail as unavailable."""
from __future__ import annotations

from collections.abc import Sequence

import grpc
import msgspec

from gateway.cluster.replica import Replica
from services.engine_client import EngineUnavailable
from services.lora_request import LoRARequest
from services.registry import Registry
from services.transport.futures import finished

LORA_CALL_TIMEOUT_S = 120.0  # reading an adapter from a slow volume


async def each_replica(replicas: Sequence[Replica], method: str, request: object) -> None:
    if not replicas:
        raise EngineUnavailable("no scheduler is ready")
    calls = [getattr(replica.stub, method).future(request, timeout=LORA_CALL_TIMEOUT_S) for replica in replicas]
    for call in calls:  # all asked at once: the wait is the slowest answer's
        await finished(call)
    for replica, call in zip(replicas, calls):
        error = call.exception()
        if error is None:
            continue
        if isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(error.details())
        raise EngineUnavailable(f"scheduler {replica.member.id} could not {method}: {error}")


def read_loras(registry: Registry) -> dict[str, LoRARequest]:
    """The adapters every gateway serves, as the registry holds them; one that does not
    decode (another version's) is left out."""
    loras = {}
    for name, value in registry.loras().items():
        try:
            loras[name] = msgspec.json.decode(value, type=LoRARequest)
        except (msgspec.DecodeError, ValueError):
            continue
    return loras
